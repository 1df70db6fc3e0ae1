"""`wanloom decode-samples`: turn a validation samples folder's latents into clips where a PyTorch VAE can run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer


def decode_samples(
    folder: Annotated[Path, typer.Argument(help="A samples/step-NNNNNN folder (copy it from gs:// first).")],
    vae: Annotated[
        Path | None, typer.Option(help="Diffusers vae/ folder to decode with. Default: the one decode.json names.")
    ] = None,
) -> None:
    """Decode a validation samples folder's latents (sample-<id>.npy) into mp4 clips and a contact sheet."""
    from wanloom_trainer.sampling import media

    try:
        spec = media.DecodeSpec.read(folder)
        if vae is not None:
            spec = dataclasses.replace(spec, vae=str(vae))
        if spec.vae is not None and spec.vae.startswith("gs://"):
            raise ValueError(f"{folder}/decode.json names {spec.vae}: copy that folder locally and pass --vae")
        names = media.decode_folder(folder, media.open_vae(spec), spec.fps)
    except (ValueError, FileNotFoundError, OSError) as exc:
        typer.echo(f"wanloom decode-samples: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {', '.join(names)} in {folder}")


def register(app: typer.Typer) -> None:
    app.command("decode-samples")(decode_samples)
