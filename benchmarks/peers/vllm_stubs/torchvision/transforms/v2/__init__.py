"""torchvision.transforms.v2: as the stand-in's transforms."""

from torchvision.transforms import InterpolationMode  # noqa: F401
