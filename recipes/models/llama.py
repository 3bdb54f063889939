"""A Llama-style decoder (RMSNorm, rotary positions, SwiGLU) from Hugging Face ``transformers``,
built from a config (no weights), as a network that maps token ids to logits.

The recipe's LightningModule keeps the loss outside the network (NOTE [ The network is self.net ]
in ``recipes/module.py``); Hugging Face's own loss and its key-value cache are not used.
"""
from __future__ import annotations

from torch import nn

__all__ = ["HFLlama"]


class HFLlama(nn.Module):
    """``transformers.LlamaForCausalLM`` returning logits.

    Args:
        vocab_size: Tokens (256 for bytes).
        block_size: Longest sequence (``max_position_embeddings``).
        n_layer, n_head, n_embd: Decoder layers, attention heads (as many key-value heads) and
            hidden width.
        intermediate_size: Width of each layer's SwiGLU MLP (Llama's ~8/3 of ``n_embd``).
        attention_dropout: Dropout on the attention weights.
    """

    def __init__(self, *, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, intermediate_size: int, attention_dropout: float = 0.0) -> None:
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=n_embd, num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=n_head,
            intermediate_size=intermediate_size, max_position_embeddings=block_size,
            attention_dropout=attention_dropout, attn_implementation="sdpa",
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
        self.lm = transformers.LlamaForCausalLM(cfg)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers: the units FSDP2 shards one by one."""
        return self.lm.model.layers

    def forward(self, idx):  # noqa: D102 - token ids (batch, length) -> logits
        return self.lm(input_ids=idx, use_cache=False).logits
