"""The JAX umT5 / T5 encoder against transformers' ``UMT5EncoderModel`` and ``T5EncoderModel`` (float32, CPU):
per-layer (umT5) and shared (T5) relative position biases, padding masked, and real tokens that do not depend on
how far the batch is padded (the tokenizer: tests/trainer/data/test_data_encoders_jax.py)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from wanloom_trainer.model.encoders import umt5_jax


@pytest.mark.parametrize("kind", ["umt5", "t5"])
def test_hidden_states_match_transformers(kind: str, tmp_path: Path) -> None:
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if kind == "umt5" else (T5Config, T5EncoderModel)
    torch.manual_seed(0)
    config = config_cls(vocab_size=300, d_model=48, d_kv=12, d_ff=96, num_layers=3, num_heads=4,
                        feed_forward_proj="gated-gelu", relative_attention_max_distance=20)  # fmt: skip
    model_cls(config).eval().save_pretrained(tmp_path / kind)
    model = model_cls.from_pretrained(tmp_path / kind).eval()
    ids = torch.randint(2, 300, (3, 77), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 40:], mask[2, 5:] = 0, 0
    ids = ids * mask
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()

    cfg, params = umt5_jax.load_text_encoder(tmp_path / kind)
    got = np.asarray(umt5_jax.encode(params, cfg, jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy())))
    for row, n in enumerate(mask.sum(dim=1).tolist()):
        assert np.abs(got[row, :n] - want[row, :n]).max() <= 1e-4 * np.abs(want[row, :n]).max()
    alone = umt5_jax.encode(params, cfg, jnp.asarray(ids.numpy()[2:, :5]), jnp.asarray(mask.numpy()[2:, :5]))
    np.testing.assert_allclose(np.asarray(alone)[0], want[2, :5], rtol=1e-4, atol=1e-5)
