"""Export a trained checkpoint (either backend) in the layouts the Wan ecosystem loads.

``wan_keys``: diffusers key names ↔ the original Wan key names (ComfyUI, DiffSynth-Studio, the Wan repository).
``safetensors_out``: a safetensors writer that takes one tensor at a time.
``sources``: the tensors of an orbax (JAX) or DCP (PyTorch) checkpoint, read one at a time in diffusers layout.
``layouts``: the two output layouts, diffusers (``transformer/`` + ``transformer_2/``) and wan (a file per expert).
"""
