"""A multimodal model whose vision tower is as deep as its text model (the tiny Qwen2-VL: 4 vision blocks, 4 decoder
layers): hscapture hooks the text model's decoder layers, not the tower's blocks. Token-id prompts only; the
captured states equal HF transformers' text-model states token by token. The tower is narrower (64) than the text
model (128), and a worker that records where the hooks sit shows the tower was built, as deep, and left alone."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import TOL, extract, prompts

from hscapture.testing.compare import compare
from hscapture.worker import CaptureWorker

pytestmark = [pytest.mark.integration, pytest.mark.newest]

LAYERS = [1, 2, 4]  # before convention: the inputs of decoder layers 1 and 2, the last layer's output (pre-norm)
DEPTH, TEXT_HIDDEN, VISION_HIDDEN = 4, 128, 64
TEXT_LAYERS, VISION_BLOCKS = "language_model.model.layers", "visual.blocks"  # vLLM's names (0.16 and 0.32)
RECORD = "TEST_MULTIMODAL_MODULE_RECORD"  # not HSCAPTURE_*: hscapture warns about unknown ones


class RecordingWorker(CaptureWorker):
    """hscapture's worker, writing after its load_model every module list of the model with, per entry, its
    type and how many forward hooks and forward pre-hooks it carries (to ``$TEST_MULTIMODAL_MODULE_RECORD``)."""

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        lists = {
            name: [[type(m).__name__, len(m._forward_hooks), len(m._forward_pre_hooks)] for m in mod]
            for name, mod in self.get_model().named_modules()
            if isinstance(mod, torch.nn.ModuleList)
        }
        with open(os.environ[RECORD], "w") as f:
            json.dump(lists, f)


def text_reference(model_path: str, ps: list[list[int]]) -> list[torch.Tensor]:
    """HF transformers' Qwen2-VL on ``input_ids`` alone (float32), read with hooks on its text model's decoder
    layers: before id ``i`` is the output of layer ``i - 1``. Per prompt [L, len(LAYERS), TEXT_HIDDEN]."""
    import transformers

    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    layers = model.model.language_model.layers
    assert len(layers) == DEPTH and len(model.model.visual.blocks) == DEPTH
    grabbed: dict[int, torch.Tensor] = {}

    def hook(slot):
        def post(_m, _a, out):
            grabbed[slot] = (out[0] if isinstance(out, (tuple, list)) else out).detach().float()

        return post

    handles = [layers[i - 1].register_forward_hook(hook(slot)) for slot, i in enumerate(LAYERS)]
    out = []
    with torch.no_grad():
        for ids in ps:
            grabbed.clear()
            model(input_ids=torch.tensor([ids]))
            out.append(torch.stack([grabbed[s][0] for s in range(len(LAYERS))], dim=1))
    for h in handles:
        h.remove()
    return out


def test_the_text_models_layers_are_hooked_not_the_equally_deep_vision_tower(tmp_path, tiny_model, monkeypatch):
    model = tiny_model("qwen2_vl")
    cfg = json.loads(open(os.path.join(model, "config.json")).read())
    assert cfg["text_config"]["num_hidden_layers"] == cfg["vision_config"]["depth"] == DEPTH
    assert (cfg["text_config"]["hidden_size"], cfg["vision_config"]["embed_dim"]) == (TEXT_HIDDEN, VISION_HIDDEN)
    record = tmp_path / "modules.json"
    monkeypatch.setenv(RECORD, str(record))
    ps = prompts(11)
    rep, samples = extract(
        tmp_path,
        model,
        ps,
        tp=1,
        convention="before",
        layers=LAYERS,
        llm_kwargs={"worker_cls": f"{__name__}.RecordingWorker"},
    )

    # vLLM built the tower, as deep as the text model and unhooked; the text layers 0, 1, 3 have the output hooks.
    lists = json.loads(record.read_text())
    assert lists[VISION_BLOCKS] == [["Qwen2VisionBlock", 0, 0]] * DEPTH, lists[VISION_BLOCKS]
    assert [t for t, _, _ in lists[TEXT_LAYERS]] == ["Qwen2DecoderLayer"] * DEPTH
    assert [i for i, (_, post, _) in enumerate(lists[TEXT_LAYERS]) if post] == [i - 1 for i in LAYERS]
    assert [n for n, entries in lists.items() if n != TEXT_LAYERS and any(a or b for _, a, b in entries)] == []

    assert rep.samples == len(ps) and rep.tokens == sum(map(len, ps))
    for p, s in zip(ps, samples, strict=True):
        assert s["token_ids"].tolist() == p
        assert tuple(s["hidden_states"].shape) == (len(p), len(LAYERS), TEXT_HIDDEN)
    cmp = compare([s["hidden_states"] for s in samples], text_reference(model, ps))
    assert cmp.ok(TOL), f"worst relative error {cmp.worst:.2e} at (sample, token, slot) {cmp.where}"
