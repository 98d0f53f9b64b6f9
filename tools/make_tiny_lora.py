"""Tiny LoRA files for the tiny pipelines, built offline and deterministically (seeded):
`python tools/make_tiny_lora.py MODEL_DIR OUT.safetensors [--family flux2|flux1] [--seed N] [--alpha A]`.

Tests and tools/bench/lora.py build theirs with `make_lora`."""

from __future__ import annotations

from pathlib import Path

# Modules each tiny LoRA covers: column-wise, row-wise and packed layers under tp, an unsharded one, and the
# text encoder's attention and MLP (column- and row-wise under its own plan).
FLUX2 = {
    "transformer": [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_out.0",
        "transformer_blocks.0.ff.linear_in",
        "transformer_blocks.0.ff.linear_out",
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        "single_transformer_blocks.0.attn.to_out",
        "x_embedder",
    ],
    "text_encoder": [
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.0.self_attn.o_proj",
        "model.language_model.layers.1.mlp.down_proj",
    ],
}
FLUX1 = {
    "transformer": [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_out.0",
        "transformer_blocks.0.ff.net.2",
        "single_transformer_blocks.0.proj_out",
        "context_embedder",
    ],
    "text_encoder": ["encoder.layers.0.self_attn.q_proj", "encoder.layers.0.mlp.fc2"],
}


def make_lora(
    model_dir: Path,
    out: Path,
    modules: dict[str, list[str]],
    seed: int,
    rank: int = 4,
    std: float = 0.5,
    alpha: float | None = None,
) -> Path:
    """A LoRA in diffusers/PEFT keys (`<component>.<module>.lora_A.weight`, ...) for the pipeline at model_dir;
    with `alpha`, also kohya-style `<component>.<module>.alpha` keys (PEFT scaling alpha / rank)."""
    import torch
    from safetensors.torch import save_file

    from launcher.worker.lora import skeletons

    models = skeletons(str(model_dir), list(modules))
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for comp, names in modules.items():
        for n in names:
            o, i = models[comp].get_submodule(n).weight.shape
            sd[f"{comp}.{n}.lora_A.weight"] = torch.randn(rank, i, generator=g) * std
            sd[f"{comp}.{n}.lora_B.weight"] = torch.randn(o, rank, generator=g) * std
            if alpha is not None:
                sd[f"{comp}.{n}.alpha"] = torch.tensor(float(alpha))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out))
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", type=Path, help="the tiny pipeline's folder")
    parser.add_argument("out", type=Path, help="the .safetensors file to write")
    parser.add_argument("--family", default="flux2", choices=["flux2", "flux1"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=None)
    args = parser.parse_args()
    print(make_lora(args.model, args.out, {"flux2": FLUX2, "flux1": FLUX1}[args.family], args.seed, alpha=args.alpha))
