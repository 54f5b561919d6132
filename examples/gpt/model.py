"""A small GPT-Neo-like decoder: learned positions, pre-LayerNorm blocks, GELU
MLP, tied embeddings, and GPT-Neo's alternating global/local causal attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    local_window: int = 64  # odd layers attend to the last `local_window` tokens only (GPT-Neo)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, local: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.n_heads = cfg.n_heads
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
        if local:
            mask &= ~torch.ones_like(mask).tril(-cfg.local_window)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t])
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, local=i % 2 == 1) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.T  # tied output embedding


def build_model(name: str, cfg: GPTConfig) -> nn.Module:
    """``gpt``: the model above; ``hf-gpt-neo``: Hugging Face's GPTNeoForCausalLM from a config (no download)."""
    if name == "gpt":
        return GPT(cfg)
    if name == "hf-gpt-neo":
        try:
            from transformers import GPTNeoConfig, GPTNeoForCausalLM
        except ImportError as exc:
            raise SystemExit("--model hf-gpt-neo needs transformers: pip install 'transformers>=5.23'") from exc
        hf = GPTNeoConfig(
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.seq_len,
            hidden_size=cfg.d_model,
            num_layers=cfg.n_layers,
            num_heads=cfg.n_heads,
            attention_types=[[["global", "local"], cfg.n_layers // 2]] if cfg.n_layers % 2 == 0 else [[["global"], cfg.n_layers]],
            window_size=cfg.local_window,
            intermediate_size=4 * cfg.d_model,
        )
        return _LogitsOnly(GPTNeoForCausalLM(hf))
    raise SystemExit(f"unknown --model {name!r}: use gpt or hf-gpt-neo")


class _LogitsOnly(nn.Module):
    """Make a Hugging Face causal LM return logits like the example's GPT."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits
