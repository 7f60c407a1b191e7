"""The three drafters, in the layouts their published checkpoints use.

- EAGLE-1: fc over [token embedding; target hidden] -> decoder layer(s) (the first without an input
  norm) -> the target's LM head. Each chain step feeds its own output hidden state back.
- EAGLE-3: fc fuses three target layers' outputs; one layer whose attention reads [norm(embedding);
  norm(hidden)]; its own norm and reduced-vocabulary head, mapped back with d2t (target id = id + d2t[id]).
- DFlash: fc over the chosen target layers gives the context; every layer projects it to keys and
  values (stored in the drafter's cache), and the block [last token, MASK x (B-1)] attends over context
  and block in one pass (non-causal unless configured causal). Embedding and LM head are the target's.

Embeddings are always the target's (`TargetHeads`, borrowed, never copied): checkpoints that carry a
frozen copy have it ignored, as vLLM and SGLang do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor_service.models.attention_step import AttentionStep
from executor_service.models.draft_config import DraftConfig
from executor_service.models.fused_layer import NormInput, linear, norm_input, project
from executor_service.models.fused_ops import argmax
from executor_service.models.model import MLP, Attention, DecoderLayer, RMSNorm, Rotary
from executor_service.models.rope import RotaryEmbedding

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TargetHeads:
    """The target's embedding and LM head, used by drafters without registering them as their own."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


class TargetVocabulary:
    """Drafters that read the target's own LM head: their draft ids are target ids."""

    target: TargetHeads | None

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits [N, V]: what greedy drafting takes the argmax of and sampled drafting draws from."""
        assert self.target is not None
        return self.target.lm_head(hidden)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return argmax(self.draft_logits(hidden))


class EagleDrafter(TargetVocabulary, nn.Module):
    """EAGLE-1."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        model = config.model
        self.config = config
        self.fc = nn.Linear(2 * model.hidden_size, model.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(model) for _ in range(model.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1's first layer reads fc's output as is
        self.rope = RotaryEmbedding(model)
        self.target: TargetHeads | None = None

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        return features  # the target's final normed hidden state

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.target is not None
        return self.target.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_caches: KVCaches,
        step: AttentionStep, rotary: Rotary | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(hidden fed to the next chain step, hidden the head reads). `rotary`: the positions' cos and sin when
        the caller looked them up already (a tree's passes, once per step for all of them)."""
        x = project(NormInput(self.embed(input_ids), x2=hidden), self.fc)  # fc over [embedding | hidden]
        rotary = self.rope.lookup(positions, x.dtype) if rotary is None else rotary
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rotary, kv_caches[index], step)
        x = x if residual is None else x + residual
        return x, x


class Eagle3Layer(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        model = config.model
        self.input_layernorm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.hidden_norm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.self_attn = Attention(model, input_size=2 * model.hidden_size)
        self.post_attention_layernorm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.mlp = MLP(model)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: Rotary, kv_cache: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(the MLP output, the residual stream it is to be added to), as DecoderLayer's. The attention reads
        [input_layernorm(embeds) | hidden_norm(hidden)]: in the QKV kernel's prologue where it is fused."""
        eps = self.input_layernorm.eps
        inp = NormInput(embeds, None, self.input_layernorm.weight, eps, hidden, self.hidden_norm.weight)
        out, _ = self.self_attn(inp, rotary, kv_cache, step)
        return self.mlp.fused(norm_input(out, hidden, self.post_attention_layernorm))  # ... and adds to hidden


class Eagle3Drafter(nn.Module):
    """EAGLE-3."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        model = config.model
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * model.hidden_size, model.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.lm_head = nn.Linear(model.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.rope = RotaryEmbedding(model)
        self.target: TargetHeads | None = None

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)  # low, middle and high target features -> one hidden state

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.target is not None
        return self.target.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_caches: KVCaches,
        step: AttentionStep, rotary: Rotary | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(pre-norm hidden fed to the next chain step, normed hidden the head reads). `rotary`: as
        EagleDrafter's."""
        rotary = self.rope.lookup(positions, hidden.dtype) if rotary is None else rotary
        out, residual = self.midlayer(self.embed(input_ids), hidden, rotary, kv_caches[0], step)
        normed, out = self.norm.add_forward(out, residual)
        return out, normed

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The reduced head's logits [N, draft_vocab_size]; their ids map to the target's with `to_target`."""
        return self.lm_head(hidden)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.to_target(argmax(self.draft_logits(hidden)))

    def target_ids(self) -> torch.Tensor:
        """The draft vocabulary as target ids [draft_vocab_size]: what each row of the head stands for."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t


class DFlashDrafter(TargetVocabulary, nn.Module):
    """DFlash (z-lab): a block-diffusion drafter that proposes block_size - 1 tokens in one pass."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        model = config.model
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * model.hidden_size, model.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(model) for _ in range(model.num_layers))
        self.norm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.rope = RotaryEmbedding(model)
        self.target: TargetHeads | None = None

    def store_context(
        self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_caches: KVCaches
    ) -> None:
        """Target features [T, n*H] of verified positions -> every layer's context keys and values."""
        context = norm_input(linear(features, self.fc), None, self.hidden_norm)
        if self.layers[0].self_attn.context_kv_config(context, kv_caches[0]) is None:
            context = NormInput(context.apply()[0])  # unfused: normed once for every layer
        rotary = self.rope.lookup(positions, context.x.dtype)
        for index, layer in enumerate(self.layers):  # fused: each layer's K/V kernel norms in its prologue
            layer.self_attn.store_context_kv(context, rotary, kv_caches[index], slots)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, step: AttentionStep
    ) -> torch.Tensor:
        """The block's normed hidden states; `step.causal` is the drafter's configured causality (R9)."""
        assert self.target is not None
        x = self.target.embed_tokens(input_ids)
        rotary = self.rope.lookup(positions, x.dtype)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rotary, kv_caches[index], step)
        return self.norm.add_forward(x, residual)[0]


Drafter = EagleDrafter | Eagle3Drafter | DFlashDrafter
DRAFTERS: dict[str, type[Drafter]] = {"eagle": EagleDrafter, "eagle3": Eagle3Drafter, "dflash": DFlashDrafter}
