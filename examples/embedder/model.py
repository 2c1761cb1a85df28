"""A sentence embedder (all-MiniLM-L6-v2's layout: a 6-layer, 384-wide BERT encoder) with
sentence-transformers' mean pooling: the token vectors averaged over the attention mask, one
vector per text. Built from `config.json` beside this file; its state dict is the encoder's
Hugging Face checkpoint, key for key."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertConfig, BertModel


class SentenceEmbedder(BertModel):
    def __init__(self) -> None:
        config = BertConfig.from_json_file(Path(__file__).with_name("config.json"))
        super().__init__(config, add_pooling_layer=False)

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        tokens = super().forward(input_ids=input_ids, attention_mask=attention_mask)
        weights = attention_mask.unsqueeze(-1).to(tokens.last_hidden_state.dtype)
        summed = (tokens.last_hidden_state * weights).sum(dim=1)
        return summed / weights.sum(dim=1).clamp(min=1e-9)
