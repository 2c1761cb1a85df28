"""A TorchServe 0.12 handler for the zoo's GPT-2, as a TorchServe user writes greedy generation
with Hugging Face `tokenizers` (the archive's tokenizer.json) and the TorchScript model: the
batch's prompts left-padded with their attention mask, one model call per new token for the
whole batch, each answer's text returned when the batch is done. The same algorithm as
scriptserve's `text_generator` (no key/value cache, stop at `max_tokens` or `<|endoftext|>`).
Packed by benchmarks/torchserve.py; TorchServe wants one class per file."""

import contextlib
import json
import os

import torch
from ts.torch_handler.base_handler import BaseHandler

DEFAULT_MAX_TOKENS = 16


class GenerateHandler(BaseHandler):
    """`{"text_input": ..., "max_tokens": N}` (or plain text) -> its greedy continuation."""

    def initialize(self, context):
        super().initialize(context)
        from tokenizers import Tokenizer

        model_dir = context.system_properties.get("model_dir")
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.tokenizer.no_padding()
        self.eos = self.tokenizer.token_to_id("<|endoftext|>")

    def preprocess(self, data):
        prompts = []
        for row in data:
            raw = row.get("data") or row.get("body")
            if isinstance(raw, (bytes, bytearray)):
                raw = raw.decode()
                with contextlib.suppress(ValueError):  # plain text: the prompt itself
                    raw = json.loads(raw)
            if isinstance(raw, dict):
                text, limit = raw["text_input"], int(raw.get("max_tokens", DEFAULT_MAX_TOKENS))
            else:
                text, limit = str(raw), DEFAULT_MAX_TOKENS
            prompts.append((self.tokenizer.encode(text, add_special_tokens=False).ids, limit))
        return prompts

    def inference(self, data, *args, **kwargs):
        rows = [list(ids) for ids, _ in data]
        limits = [limit for _, limit in data]
        made = [[] for _ in rows]
        done = [False] * len(rows)
        with torch.inference_mode():
            for _ in range(max(limits)):
                width = max(len(r) for r in rows)
                ids = torch.full((len(rows), width), self.eos, dtype=torch.int64)
                mask = torch.zeros((len(rows), width), dtype=torch.int64)
                for i, row in enumerate(rows):
                    ids[i, width - len(row) :] = torch.tensor(row)
                    mask[i, width - len(row) :] = 1
                tokens = self.model(ids, mask).argmax(-1).tolist()
                for i, token in enumerate(tokens):
                    if done[i]:
                        continue
                    if token == self.eos:
                        done[i] = True
                        continue
                    rows[i].append(token)
                    made[i].append(token)
                    done[i] = len(made[i]) >= limits[i]
                if all(done):
                    break
        return made

    def postprocess(self, data):
        return [self.tokenizer.decode(tokens) for tokens in data]
