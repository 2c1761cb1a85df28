"""A TorchServe 0.12 handler for the zoo's text models: Hugging Face `tokenizers` (the
archive's tokenizer.json), then the TorchScript model. Packed by benchmarks/torchserve.py;
TorchServe wants one class per file."""

import json
import os

import torch
from ts.torch_handler.base_handler import BaseHandler


class TextHandler(BaseHandler):
    """Texts -> the tokenizer.json beside the model, padded to the batch's longest -> labels
    (a classifier) or a normalised mean-pooled vector (an embedder, `embedder` in the name)."""

    def initialize(self, context):
        super().initialize(context)
        from tokenizers import Tokenizer

        model_dir = context.system_properties.get("model_dir")
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self.tokenizer.enable_truncation(512)
        self.embedder = "embedder" in context.model_name
        with open(os.path.join(model_dir, "inputs.json")) as fh:
            self.inputs = json.load(fh)

    def preprocess(self, data):
        texts = []
        for row in data:
            raw = row.get("data") or row.get("body")
            texts.append(raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw))
        encodings = self.tokenizer.encode_batch(texts)
        columns = {
            "input_ids": [e.ids for e in encodings],
            "attention_mask": [e.attention_mask for e in encodings],
            "token_type_ids": [e.type_ids for e in encodings],
        }
        return {n: torch.tensor(columns[n], dtype=torch.int64) for n in self.inputs}

    def inference(self, data, *args, **kwargs):
        with torch.inference_mode():
            return self.model(*(data[n] for n in self.inputs))

    def postprocess(self, data):
        if self.embedder:
            return torch.nn.functional.normalize(data, dim=1).tolist()
        probs = torch.softmax(data, dim=1)
        return [{str(i): float(p) for i, p in enumerate(row)} for row in probs.tolist()]
