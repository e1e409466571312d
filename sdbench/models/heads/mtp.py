"""An MTP module's forward (DeepSeek-V3's multi-token prediction as Qwen3-Next, Qwen3.5 and MiMo ship it; speculators
`MTPDraftModel`, vLLM's `mtp` method): x = input_proj(cat(token_layernorm(e), hidden_layernorm(h))) of the next
token's embedding e and the state h it follows (the target's final-norm state, or the module's own output fed
back), one decoder layer over x (its input norm, attention, post-attention norm, MLP, residuals as the target's
own layers), o = final_layernorm(its output), fed back and read by the target's own head: logits = head(o). The
module keeps its own position-indexed KV cache, as an EAGLE head does, and drafts through EAGLE's drafter (a
chain, a token tree, or EAGLE-2's dynamic tree).
"""

from __future__ import annotations

import torch

from sdbench.models.heads.eagle import EagleHead, rms_norm


class MTPHead(EagleHead):
    """An MTP module over a target runner (its embedding and head)."""

    def _inputs(self, e: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._linear("input_proj", torch.cat((rms_norm(e, self.w["token_layernorm.weight"], self.eps),
                                                  rms_norm(states, self.w["hidden_layernorm.weight"], self.eps)), -1))
        return rms_norm(x, self.w["input_layernorm.weight"], self.eps), x

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.w["final_layernorm.weight"], self.eps)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.target.logits(out)
