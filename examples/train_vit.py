"""Train a Vision Transformer (random weights, no download): bf16 autocast, fused AdamW, torch.compile.

    python examples/train_vit.py                   # small and fast, CPU (CUDA when present)
    python examples/train_vit.py --full            # ViT-B/16: 224 x 224, 12 layers, 768 wide, batch 64
    python examples/train_vit.py --impl torchvision
    memprof trace examples/train_vit.py --budget 0.05

The model comes from timm (`VisionTransformer`), torchvision (`models.VisionTransformer`) or
transformers (`ViTForImageClassification`): `--impl auto` takes the first of them installed.
Random images and labels; cross entropy on the class logits.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, replace

import torch
from _zoo import parser, sized, train

IMPLS = ("timm", "torchvision", "transformers")


@dataclass(frozen=True)
class ViTSize:
    layers: int
    hidden: int
    heads: int
    mlp: int
    image: int
    patch: int
    classes: int
    batch: int
    impl: str = "auto"


SMALL = ViTSize(layers=2, hidden=64, heads=4, mlp=256, image=32, patch=8, classes=10, batch=4)
FULL = ViTSize(layers=12, hidden=768, heads=12, mlp=3072, image=224, patch=16, classes=1000, batch=64)
DTYPE = "bf16"


class MissingPackage(RuntimeError):
    pass


def pick(impl: str) -> str:
    """The implementation to build from: `impl` itself, or for "auto" the first installed."""
    wanted = IMPLS if impl == "auto" else (impl,)
    for name in wanted:
        if importlib.util.find_spec(name) is not None:
            return name
    if impl == "auto":
        raise MissingPackage("train_vit.py needs timm, torchvision or transformers: pip install timm")
    raise MissingPackage(f"--impl {impl} needs the package {impl}: pip install {impl}")


def build(size: ViTSize, device: str, seed: int = 1337) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model (train mode) and a batch of random images and labels on `device`."""
    impl = pick(size.impl)
    torch.manual_seed(seed)
    model: torch.nn.Module
    if impl == "timm":
        from timm.models.vision_transformer import VisionTransformer as TimmViT

        model = TimmViT(img_size=size.image, patch_size=size.patch, num_classes=size.classes,
                        embed_dim=size.hidden, depth=size.layers, num_heads=size.heads,
                        mlp_ratio=size.mlp / size.hidden)
    elif impl == "torchvision":
        from torchvision.models import VisionTransformer as TorchvisionViT

        model = TorchvisionViT(image_size=size.image, patch_size=size.patch, num_layers=size.layers,
                               num_heads=size.heads, hidden_dim=size.hidden, mlp_dim=size.mlp,
                               num_classes=size.classes)
    else:
        from transformers import ViTConfig, ViTForImageClassification

        model = _Logits(ViTForImageClassification(ViTConfig(
            image_size=size.image, patch_size=size.patch, hidden_size=size.hidden, num_hidden_layers=size.layers,
            num_attention_heads=size.heads, intermediate_size=size.mlp, num_labels=size.classes,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")))
    model = model.to(device).train()
    images = torch.randn(size.batch, 3, size.image, size.image, device=device)
    labels = torch.randint(0, size.classes, (size.batch,), device=device)
    return model, (images, labels)


class _Logits(torch.nn.Module):
    """transformers' ViT returning its logits, as timm's and torchvision's do."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.inner(pixel_values=images).logits  # type: ignore[no-any-return]


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return torch.nn.functional.cross_entropy(model(images), labels)


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for path in ("blocks", "encoder.layers", "inner.vit.encoder.layer"):
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.Module):
            return list(obj.children())
    raise ValueError(f"no transformer blocks found in {type(model).__name__}")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__ or "", DTYPE)
    p.add_argument("--impl", choices=["auto", *IMPLS], default="auto", help="where the model comes from")
    args = p.parse_args(argv)
    size = replace(sized(FULL if args.full else SMALL, args), impl=args.impl)
    try:
        model, batch = build(size, args.device)
    except MissingPackage as exc:
        print(f"train_vit.py: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    train(args, model, batch, loss_fn)


if __name__ == "__main__":
    main()
