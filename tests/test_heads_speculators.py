"""EAGLE-3 against the `speculators` package's own model (the one whose checkpoints vLLM loads): a random
Eagle3DraftModel saved by speculators itself, read back by sdbench's loader; given the same target states and
tokens, sdbench's head gives the same draft logits at every position (speculators' first TTT step) and, at the
last position, the same logits for the next draft fed the head's own output (its second step). Skipped where
speculators is not installed (`make setup` installs it; not a dependency of sdbench), failed in CI."""

from __future__ import annotations

import pytest
import torch

try:
    import speculators.models.eagle3  # noqa: F401
except ImportError:  # `make setup` installs it (requirements-reference.txt): in CI a skip would hide the test
    from tests.conftest import skip_unless_ci

    skip_unless_ci("the speculators package is not installed (make setup installs it)")

from transformers import LlamaConfig  # noqa: E402

from sdbench.models.heads.eagle import EagleHead  # noqa: E402
from sdbench.models.heads.load import load_head  # noqa: E402
from sdbench.models.forward.runner import ModelRunner  # noqa: E402
from tests.heads import small_vocab_target  # noqa: E402

S = 7


def _speculators_model(target, norm_before_residual: bool):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    H, V = target.config.hidden_size, target.config.vocab_size
    layer = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=H // 2, rms_norm_eps=1e-6,
                        max_position_embeddings=256)
    layer._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=6, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=[2, 2, 1],
        speculators_config=SpeculatorsConfig(algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig()],
                                             default_proposal_method="greedy",
                                             verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = Eagle3DraftModel(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.3 * torch.randn(p.shape, generator=g))
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    ids = torch.tensor([0, 1, 3, 4, 6, 7])
    model.load_vocab_mappings(torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True), ids - torch.arange(6))
    return model


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_logits_equal_speculators(tmp_path, norm_before_residual):
    target = small_vocab_target("llama")
    theirs = _speculators_model(target, norm_before_residual)
    theirs.save_pretrained(tmp_path / "head")
    runner = ModelRunner(target)
    head = EagleHead(load_head(str(tmp_path / "head"), runner), runner)
    g = torch.Generator().manual_seed(4)
    states = torch.randn(1, S, 3 * 32, generator=g)  # the three target layers' states
    tokens = torch.randint(0, 8, (1, S), generator=g)
    seen = []
    hook = theirs.lm_head.register_forward_hook(lambda m, i, o: seen.append(o[0].detach()))
    with torch.no_grad():
        theirs(hidden_states=states, input_ids=tokens, document_ids=torch.zeros(1, S, dtype=torch.long), ttt_steps=2)
    hook.remove()
    cache = head.new_cache(1, 64)
    outs = []
    for i in range(S):  # every position's output, through sdbench's cache
        _, out = head.forward(cache, tokens, states, [0], torch.tensor([i]))
        torch.testing.assert_close(head.draft_logits(out)[0], seen[0][i], atol=1e-4, rtol=1e-4)
        outs.append(out)
    # speculators' second step at the last position: token 0 (its padding) fed with the head's own output
    _, nxt = head.forward(cache, torch.zeros(1, 1, dtype=torch.long), outs[-1][:, None], [S], torch.tensor([0]))
    torch.testing.assert_close(head.draft_logits(nxt)[0], seen[1][S - 1], atol=1e-4, rtol=1e-4)
