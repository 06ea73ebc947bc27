"""torchvision.transforms.v2.functional: as the stand-in's transforms.functional."""

from torchvision.transforms.functional import __getattr__  # noqa: F401
