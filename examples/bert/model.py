"""BERT-base sequence classification, as model-archiver exports it: built from `config.json`
beside this file, taking the tokenizer's three tensors by name and returning the logits alone.
The sequence dimension is exported dynamic up to the config's `max_position_embeddings`."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification


class BertClassifier(BertForSequenceClassification):
    def __init__(self) -> None:
        super().__init__(BertConfig.from_json_file(Path(__file__).with_name("config.json")))

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
    ) -> torch.Tensor:
        return (
            super()
            .forward(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            .logits
        )
