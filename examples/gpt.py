"""A small Megatron-style GPT: the block that tests, benchmarks and the training example share.

Megatron conventions: activations are ``[seq, batch, hidden]``; a block's forward takes
``hidden_states`` plus an optional ``attention_mask`` keyword (bool, True = masked out) and
returns ``(hidden_states, context)`` with ``context`` None; attention dropout is drawn
under the tracker's ``'model-parallel-rng'`` fork (it would differ per TP rank), hidden
dropout from the default generator (identical on every TP rank).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import rng
from checkpointing import checkpoint


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: fused-QKV causal attention and a GeLU MLP.

    Args:
        hidden: hidden size ``h``; heads: attention heads (``h % heads == 0``).
        dropout: hidden dropout (bias-dropout-add after attention and MLP).
        attention_dropout: dropout on attention probabilities (defaults to ``dropout``).
        recompute: wrap the whole block in ``checkpoint()`` (full activation recompute).
        use_reentrant: which checkpoint path ``recompute`` uses.
        get_rng_tracker: returns the tracker for attention dropout (default: ours).
        column_linear, row_linear: build the linears that a tensor-parallel block splits
            by output (QKV, fc1) and by input (proj, fc2); ``nn.Linear`` here, the
            parallel ones of ``examples/parallel.py`` in ``ParallelGPTBlock``.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        dropout: float = 0.0,
        attention_dropout: float | None = None,
        recompute: bool = False,
        use_reentrant: bool = True,
        get_rng_tracker: Callable[[], object] = rng.get_cuda_rng_tracker,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        column_linear: Callable[..., nn.Module] = nn.Linear,
        row_linear: Callable[..., nn.Module] = nn.Linear,
    ):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"GPTBlock: hidden {hidden} is not divisible by heads {heads}.")
        kw = {"device": device, "dtype": dtype}
        self.heads = heads
        self.head_dim = hidden // heads
        self.dropout = dropout
        self.attention_dropout = dropout if attention_dropout is None else attention_dropout
        self.recompute = recompute
        self.use_reentrant = use_reentrant
        self.get_rng_tracker = get_rng_tracker
        self.ln_attn = nn.LayerNorm(hidden, **kw)
        self.qkv = column_linear(hidden, 3 * hidden, **kw)
        self.proj = row_linear(hidden, hidden, **kw)
        self.ln_mlp = nn.LayerNorm(hidden, **kw)
        self.fc1 = column_linear(hidden, 4 * hidden, **kw)
        self.fc2 = row_linear(4 * hidden, hidden, **kw)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        if self.recompute:
            out = checkpoint(self._block, hidden_states, attention_mask, **self._checkpoint_options())
        else:
            out = self._block(hidden_states, attention_mask)
        return out, None

    def _checkpoint_options(self) -> dict:
        return {"use_reentrant": self.use_reentrant, "get_rng_state_tracker": self.get_rng_tracker}

    def _block(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self._bias_dropout(self._attention(self.ln_attn(x), attention_mask))
        return x + self._bias_dropout(self.fc2(F.gelu(self.fc1(self.ln_mlp(x)))))

    def _bias_dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training)

    def _attention(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        # The shapes come from the QKV output: a tensor-parallel block holds heads / TP
        # heads, and under sequence parallelism x holds s / TP positions.
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        head = self.head_dim
        # [s, b, heads * 3 * head] -> [b, heads, s, 3 * head] -> q, k, v
        qkv = qkv.view(s, b, -1, 3 * head).permute(1, 2, 0, 3)
        q, k, v = qkv.split(head, dim=-1)
        p = self.attention_dropout if self.training else 0.0
        with self.get_rng_tracker().fork():
            if attention_mask is None:
                ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            else:
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=p)
        return self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))


class GPT(nn.Module):
    """Embedding, a stack of :class:`GPTBlock` and a tied output layer.

    ``forward(tokens [b, s]) -> logits [s, b, vocab]``; ``layers`` is an ``nn.ModuleList``
    whose entries may be replaced by graphed callables.
    """

    def __init__(
        self,
        vocab: int,
        seq: int,
        hidden: int,
        heads: int,
        layers: int,
        dropout: float = 0.0,
        recompute: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.word = nn.Embedding(vocab, hidden, **kw)
        self.position = nn.Embedding(seq, hidden, **kw)
        self.dropout = dropout
        self.layers = nn.ModuleList(
            GPTBlock(hidden, heads, dropout, recompute=recompute, **kw) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(hidden, **kw)
        self._init_weights(layers)

    def _init_weights(self, layers: int) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if not name.endswith("weight") else nn.init.ones_(p)
            elif name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2.0 * layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` tokens to ``[s, b, h]`` hidden states."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = (self.word(tokens) + self.position(positions)).transpose(0, 1).contiguous()
        return F.dropout(x, self.dropout, self.training)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` to logits ``[s, b, vocab]`` (tied to the word embedding)."""
        return F.linear(self.ln_f(x), self.word.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x, _ = layer(x)
        return self.head(x)


def causal_mask(seq: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Megatron-style ``[1, 1, s, s]`` bool mask, True where attention is masked out."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
