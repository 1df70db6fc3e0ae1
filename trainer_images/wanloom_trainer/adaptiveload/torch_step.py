"""A shape-benchmark ``step_fn`` that runs real diffusers ``WanTransformer3DModel`` training steps on one device.

The only module of ``adaptiveload`` that touches torch, imported lazily: the planner itself stays numpy-only. It
serves local runs (the ``tiny`` variant on CPU, or one GPU for a single-device job); a distributed trainer passes its
own ``step_fn`` running the job's real parallel step instead.
"""

from __future__ import annotations

from wanloom_trainer.adaptiveload.shape_bench import StepFn
from wanloom_trainer.config.variants import WanVariant


def diffusers_step_fn(variant: WanVariant, device: str = "cpu", seed: int = 0, threads: int | None = None) -> StepFn:
    """Build the model once and return ``step_fn(batch, latent_shape)``: flow-matching MSE, backward, AdamW step.

    Args:
        variant: model size; the transformer is randomly initialised (timing does not depend on weights).
        device: "cpu" or a CUDA device.
        seed: initialisation and input seed.
        threads: torch CPU threads (None leaves torch's default).
    """
    import torch
    from diffusers import WanTransformer3DModel

    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**variant.diffusers_config()).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def step(batch: int, latent_shape: tuple[int, int, int]) -> None:
        x0 = torch.randn(batch, variant.out_channels, *latent_shape, generator=generator).to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        sigma = torch.rand(batch, generator=generator).to(device)
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        if variant.in_channels > variant.out_channels:  # image-conditioned models: mask + condition channels
            cond = torch.zeros(batch, variant.in_channels - variant.out_channels, *latent_shape, device=device)
            x_t = torch.cat([x_t, cond], dim=1)
        text = torch.randn(batch, variant.text_len, variant.text_dim, generator=generator).to(device)
        pred = model(x_t, sigma * 1000.0, text, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    return step
