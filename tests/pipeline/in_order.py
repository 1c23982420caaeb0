"""The check a split passes: its stages, run one after another on real data, give the model's logits and loss."""

import torch


def assert_stages_give_the_models_output(model, cut, ids, labels):
    """``cut``'s stages 0-1, 1-3, 3-4 in order on ``ids`` equal ``model``'s logits and loss, bit for bit."""
    with torch.no_grad():
        want = model(ids, labels=labels)
        h = ids
        for lo, hi in ((0, 1), (1, 3), (3, 4)):
            h = cut.stage(lo, hi)(h)
        assert torch.equal(h, want.logits)
        assert torch.equal(cut.loss(h, labels), want.loss)
