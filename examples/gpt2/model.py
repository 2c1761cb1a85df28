"""GPT-2 small for generation, as model-archiver exports it: built from `config.json` beside
this file, it takes a batch of left-padded token ids with their attention mask and returns the
logits of the next token of each row ([batch, vocabulary]). Positions are counted from each
row's first real token, so that a padded row generates as it would alone."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel


class GPT2NextToken(GPT2LMHeadModel):
    def __init__(self) -> None:
        super().__init__(GPT2Config.from_json_file(Path(__file__).with_name("config.json")))

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=False,
        )
        return out.logits[:, -1, :]
