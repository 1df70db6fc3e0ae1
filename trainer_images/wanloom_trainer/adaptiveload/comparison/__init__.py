"""AdaptiveLoad against the samplers users would otherwise run: the comparison, ``wanloom plan``'s report and
the synthetic shape mixes it is measured on."""
