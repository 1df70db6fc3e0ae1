"""The encoders the transformer is conditioned on, in JAX, for TPU hosts without PyTorch: the Wan VAE (2.1 and 2.2;
encode for data preparation, decode for validation videos) and the umT5/T5 text encoder with its tokenizer. Names
follow the diffusers and transformers checkpoints they load."""

from pathlib import Path

import numpy as np


def read_safetensors_folder(folder: str | Path, layout: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder's ``*.safetensors`` files, by name (``layout`` names the expected layout
    in the error when there is none)."""
    from safetensors.numpy import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights ({layout} layout expected)")
    flat: dict[str, np.ndarray] = {}
    for file in files:
        flat |= load_file(str(file))
    return flat
