"""Run Hugging Face diffusers pipelines over many devices and nodes with PyTorch Lightning."""

from lightning_diffusion import strategies
from lightning_diffusion.data import PromptDataModule
from lightning_diffusion.module import DiffusionModule
from lightning_diffusion.progress import ImageProgressBar
from lightning_diffusion.writer import ImageWriter

__all__ = ["DiffusionModule", "ImageProgressBar", "ImageWriter", "PromptDataModule", "strategies"]
__version__ = "0.1.0"
