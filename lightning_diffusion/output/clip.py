"""CLIP score from a local CLIP model folder (no download): torchmetrics' definition, 100 x
max(cosine(image, text), 0), computed here because torchmetrics 1.9's CLIPScore takes only hub
names it knows and breaks on transformers 5's ``get_image_features`` output. Used by the audit
(``writer.audit.clip_model``) and ``lightning-diffusion eval --clip``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_diffusion.core.errors import ConfigError


def folder_problem(folder: object, where: str) -> list[str]:
    """``folder`` is not a local CLIP model folder (a ``save_pretrained`` one, with config.json): one line."""
    if not isinstance(folder, str) or not (Path(folder).expanduser() / "config.json").is_file():
        return [f"{where} {folder} is not a local CLIP model folder (no config.json; a CLIPModel and its "
                "CLIPProcessor saved with save_pretrained): nothing is downloaded."]
    return []


class ClipScorer:
    """A CLIP model and processor loaded once from ``folder``, on the CPU, scoring 8-bit images
    (H x W x 3) against their prompts."""

    def __init__(self, folder: str, where: str) -> None:
        from transformers import CLIPModel, CLIPProcessor

        path = str(Path(folder).expanduser())
        try:
            self.model: Any = CLIPModel.from_pretrained(path).eval()
            self.processor: Any = CLIPProcessor.from_pretrained(path)
        except (OSError, ValueError) as err:
            said = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ConfigError(f"{where} {folder} does not load as a CLIP model and processor ({said}).") from None

    def scores(self, images: Sequence[np.ndarray], prompts: Sequence[str], batch: int = 32) -> list[float]:
        """Each image's CLIP score against its prompt."""
        import torch

        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(images), batch):
                inputs = self.processor(text=list(prompts[start:start + batch]),
                                        images=[np.asarray(i) for i in images[start:start + batch]],
                                        return_tensors="pt", padding=True, truncation=True,
                                        max_length=self.model.config.text_config.max_position_embeddings)
                output = self.model(**inputs)
                cosine = torch.nn.functional.cosine_similarity(output.image_embeds, output.text_embeds, dim=-1)
                scores += [float(v) for v in 100 * cosine.clamp(min=0)]
        return scores
