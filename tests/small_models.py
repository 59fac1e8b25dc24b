"""Small models for numerical tests: HF models from tiny configs and a plain PyTorch one."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
import transformers
from transformers.modeling_outputs import CausalLMOutput
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)


class PlainTransformer(nn.Module):
    """A decoder written with nn.Linear/LayerNorm and explicit matmul attention (not HF)."""

    def __init__(self, vocab: int = 96, hidden: int = 32, heads: int = 4, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = nn.Dropout(dropout)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            block = nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(hidden),
                    "qkv": nn.Linear(hidden, 3 * hidden),
                    "proj": nn.Linear(hidden, hidden),
                    "norm2": nn.LayerNorm(hidden),
                    "up": nn.Linear(hidden, 4 * hidden),
                    "down": nn.Linear(4 * hidden, hidden, bias=False),
                }
            )
            self.blocks.append(block)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        b, s, h = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).split(h, dim=-1)
            q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
            scores = (q @ k.transpose(-1, -2)) / (h // self.heads) ** 0.5
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
            x = x + self.dropout(blk["proj"](att.transpose(1, 2).reshape(b, s, h)))
            x = x + blk["down"](self.dropout(F.gelu(blk["up"](blk["norm2"](x)))))
        logits = self.head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return out


class TwoInputGate(nn.Module):
    """A decoder whose MLP output is scaled by a gate that reads both the normed and the raw
    residual stream, each flattened to [tokens, hidden] (not HF)."""

    def __init__(self, vocab: int = 96, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(hidden), "up": nn.Linear(hidden, 4 * hidden), "down": nn.Linear(4 * hidden, hidden, bias=False),
                           "gate_normed": nn.Linear(hidden, 1), "gate_raw": nn.Linear(hidden, 1)})  # fmt: skip
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        x = self.embed(input_ids)
        b, s, h = x.shape
        for blk in self.blocks:
            normed = blk["norm"](x).reshape(b * s, h)
            gate = torch.sigmoid(blk["gate_normed"](normed) + blk["gate_raw"](x.reshape(b * s, h)))
            x = x + (blk["down"](F.gelu(blk["up"](normed))) * gate).reshape(b, s, h)
        logits = self.head(self.norm(x))
        loss = None if labels is None else F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return CausalLMOutput(loss=loss, logits=logits)


_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)

# Decoder architectures that autotp has no specific code for (config class, model class, kwargs).
MORE_ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", _DECODER),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_DECODER, head_dim=16)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_DECODER, moe_intermediate_size=64,
                  shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_DECODER, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_DECODER, head_dim=16)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, word_embed_proj_dim=64, dropout=0.0)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(vocab_size=128, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, resid_pdrop=0.0, embd_pdrop=0.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_DECODER, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(_DECODER, hidden_dropout=0.0)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_DECODER, residual_dropout=0.0,
                   embedding_dropout=0.0)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", _DECODER),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
             resid_pdrop=0.0, embd_pdrop=0.0)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", _DECODER),
    "cohere": ("CohereConfig", "CohereForCausalLM", _DECODER),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2)),
}


def build(name: str, layers: int = 2) -> nn.Module:
    """A freshly initialized small model (seeded, eval mode, no dropout) with ``layers`` layers."""
    torch.manual_seed(0)
    if name == "gpt2":  # vocab 130: padded at tp=4; tied lm_head; fused QKV (Conv1D)
        cfg = GPT2Config(vocab_size=130, n_embd=64, n_layer=layers, n_head=4, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model: nn.Module = GPT2LMHeadModel(cfg)
    elif name == "llama":  # GQA: 8 query heads, 2 KV heads (replicated at tp=4)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2))
    elif name == "llama_kv4":  # for tp=8: 4 KV heads, each held by two ranks
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4))
    elif name in ("mixtral", "mixtral_aux"):  # mixtral_aux: the router's load-balancing loss is part of the loss
        model = MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 output_router_logits=name == "mixtral_aux", router_aux_loss_coef=0.5))
    elif name == "bert":
        model = BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    elif name == "qwen2":  # an architecture with no autotp-specific code: q/k/v biases, GQA
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    elif name == "plain":
        model = PlainTransformer()
    elif name == "two_input_gate":
        model = TwoInputGate(layers=layers)
    elif name in MORE_ARCHITECTURES:
        config_cls, model_cls, kwargs = MORE_ARCHITECTURES[name]
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    else:
        raise KeyError(name)
    return model.eval()


def vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return config.vocab_size if config is not None else model.head.out_features  # type: ignore[union-attr]


def train_side_by_side(reference: Any, other: Any, batch: dict[str, torch.Tensor], steps: int = 3, **step_kwargs: Any) -> dict[str, float]:
    """``steps`` SGD steps of two parallel models on ``batch``: the largest loss and grad differences."""
    optimizers = [torch.optim.SGD(pm.parameters(), lr=0.1) for pm in (reference, other)]
    worst = {"loss": 0.0, "grad": 0.0}
    for _ in range(steps):
        losses = [pm.train_step(**batch, **step_kwargs) for pm in (reference, other)]
        worst["loss"] = max(worst["loss"], (losses[0] - losses[1]).abs().item())
        grads = [pm.unshard_grads() for pm in (reference, other)]
        worst["grad"] = max([worst["grad"]] + [(g - grads[1][k]).abs().max().item() for k, g in grads[0].items() if g is not None])
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return worst


class DropoutAttention(torch.nn.Module):
    """Attention with SDPA's own dropout in training (GPT-2's ``attn_pdrop``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, 64))
