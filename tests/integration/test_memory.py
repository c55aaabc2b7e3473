"""MemoryMeter against torch's MemTracker on HF BERT, with and without checkpointing."""

import pytest
import torch

import memfit
from tests._models import tiny_bert


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.filterwarnings("ignore:Module is None")
def test_matches_torch_memtracker_on_hf_bert(ckpt):
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers.models.bert.modeling_bert import BertLayer

    model = tiny_bert(dropout=0.1)
    if ckpt:
        memfit.apply_activation_checkpointing(model, BertLayer)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 120, (4, 32))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    with memfit.MemoryMeter(model=model, optimizer=opt) as m:
        step()
    assert m.peak_bytes == theirs["Total"]
    b = m.breakdown()
    assert b["parameters"] == sum(p.nbytes for p in model.parameters())
    assert b["optimizer_state"] == sum(v.nbytes for s in opt.state.values() for v in s.values())
