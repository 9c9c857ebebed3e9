"""The routing explorer: its data kept inside its <script> element, its script named by the page's content-security
policy, its size for the default analysis, and, in a real headless Chromium, what it shows for a hovered token
(attention row, experts and gates) against the models' own observation of that token, with no request made."""

import base64
import hashlib
import html
import json
import re
from pathlib import Path

import pytest
import torch
from browser import CHROMIUM, WIDTH, opened

from switchbench.analysis import analyze, explorer
from switchbench.models.layers.observe import observe
from switchbench.models.presets import PRESETS
from switchbench.train import checkpoint, listops, text

LISTOPS = ("listops-transformer-h8", "listops-switchhead-h2", "listops-moa-h4", "listops-moh-h8")
TEXT = ("tiny-transformer", "tiny-switchhead")
HOSTILE = "<b>&amp;</b><!-- \"q\" 's'\n"  # 25 bytes a page could take for markup, within a tiny model's 32
STEP = 1 / explorer.LEVELS  # the page keeps attention in these steps
GATE_STEP = 1 / explorer.GATE_SCALE


def _checkpoint(folder: Path, task: str, preset: str, seed: int) -> Path:
    """An untrained model of ``preset`` saved as training saves it; its routing and attention are those of its
    seeded initialisation, which is all the page's faithfulness needs."""
    torch.manual_seed(seed)
    n_classes = listops.N_CLASSES if task == "listops" else None
    model = checkpoint.build_model(task, PRESETS[preset], n_classes)
    path = folder / preset / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    checkpoint.save(
        path,
        task=task,
        cfg=PRESETS[preset],
        model=model,
        n_classes=n_classes,
        step=0,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train={"preset": preset, "seed": 0},
    )
    return path


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict:
    """The explorer of ListOps dense, SwitchHead, MoA and MoH models and of a text dense/SwitchHead pair read on
    HOSTILE."""
    found = {}
    for task, presets, source in (("listops", LISTOPS, None), ("lm", TEXT, HOSTILE)):
        folder = tmp_path_factory.mktemp(task)
        paths = {preset: _checkpoint(folder, task, preset, seed) for seed, preset in enumerate(presets)}
        found[task] = {
            "page": analyze.explore(list(paths.values()), folder, source, sample=16),
            "paths": paths,
        }
    return found


def test_inline_data_cannot_end_its_script_element():
    data = {"tokens": ["</script>", "<!--", "&amp;", "\u2028", '"']}
    written = explorer.script_json(data)
    assert "<" not in written and ">" not in written and json.loads(written) == data


def test_the_policy_allows_the_page_script_only_and_text_is_escaped():
    record = {"maps": torch.full((1, 1, 2, 2), 0.5)}
    model = {
        "name": "<i>m</i>",
        "attention": "dense",
        "heads": 1,
        "trained": "untrained",
        "sides": {},
        "sequences": [explorer.layers([record])],
    }
    page = explorer.render("t", [{"name": "</script>", "tokens": ["<", "&"], "line_ends": []}], [model])
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = html.unescape(
        re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page).group(1)
    )
    assert policy == f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'"
    assert page.count("</script>") == 2 and "&lt;i&gt;m&lt;/i&gt;" in page and "<i>" not in page


def test_the_default_analysis_fits_in_3_mib(tmp_path):
    """The default ListOps pair and second dense seed, on the default sample: the explorer's size does not depend
    on training (8 bits a cell, every cell kept), so untrained models measure it."""
    presets = ("listops-transformer-h8", "listops-switchhead-h2", "listops-transformer-h8")
    paths = [_checkpoint(tmp_path / str(seed), "listops", p, seed) for seed, p in enumerate(presets)]
    paths[2] = paths[2].parent.rename(paths[2].parent.with_name(f"{presets[2]}-seed1")) / paths[2].name
    page = analyze.explore(paths, tmp_path, sample=analyze.SAMPLE)
    assert page.stat().st_size <= 3 * 2**20
    assert page.read_text().count('"name":"sample') == explorer.SEQUENCES - 1


def observed(path: Path, ids: list[int]) -> list[dict]:
    """The model's own record of each attention layer on ``ids``, from its checkpoint, not from the page."""
    module = checkpoint.load(path)["module"]
    with torch.no_grad(), observe(module) as records:
        module(torch.tensor([ids]))
    return [records[f"stack.blocks.{layer}.attn"] for layer in range(module.cfg.n_layers)]


def expected_row(record: dict, head: int | None, dest: int) -> torch.Tensor:
    maps = record["maps"][0]  # [H, t, t]
    return maps[:, dest].amax(0) if head is None else maps[head, dest]


def expected_choices(experts: torch.Tensor, gates: torch.Tensor, position: int, head: int | None) -> list:
    """[(head, expert, gate)] at ``position`` of [t, H, K] experts and gates."""
    heads = range(experts.shape[1]) if head is None else [head]
    return [
        (h, int(experts[position, h, c]), float(gates[position, h, c]))
        for h in heads
        for c in range(experts.shape[2])
    ]


SHOWN = """() => {
  const choices = (nodes) => [...nodes].map((n) => [Number(n.dataset.head), Number(n.dataset.expert), Number(n.dataset.gate)]);
  const tokens = [...document.querySelectorAll('#tokens .tok')];
  return {
    labels: tokens.map((n) => n.querySelector('.label').textContent),
    weights: tokens.map((n) => Number(n.dataset.weight)),
    dest: tokens.findIndex((n) => n.getAttribute('aria-selected') === 'true'),
    pinned: document.querySelectorAll('#tokens .tok.pinned').length === 1,
    dst: choices(document.querySelectorAll('#panel .dst-expert')),
    src: tokens.map((n) => choices(n.querySelectorAll('.src-expert'))),
    compare: [...document.querySelectorAll('#compare-tokens .tok')].map((n) => Number(n.dataset.weight)),
    panel: document.getElementById('panel').textContent,
  };
}"""


def assert_row(shown: list[float], expected: torch.Tensor) -> None:
    """Each weight within half a stored step of the model's (plus the page's 4-decimal rounding)."""
    assert len(shown) == len(expected)
    worst = (torch.tensor(shown, dtype=torch.float64) - expected.double()).abs().max()
    assert worst <= STEP / 2 + 1e-4, f"attention row off by {worst:.4f}"


def assert_choices(shown: list, expected: list) -> None:
    assert [(h, e) for h, e, _ in shown] == [(h, e) for h, e, _ in expected]
    for (_, _, gate), (_, _, truth) in zip(shown, expected, strict=True):
        assert abs(gate - truth) <= GATE_STEP / 2 + 1e-6


def hover(page, position: int) -> dict:
    page.hover(f'#tokens .tok[data-pos="{position}"]')
    return page.evaluate(SHOWN)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian package chromium)")
@pytest.mark.parametrize("task", ["listops", "lm"])
def test_the_hovered_token_shows_the_models_own_routing(pages, task, tmp_path):
    pytest.importorskip("playwright")
    made = pages[task]
    presets = LISTOPS if task == "listops" else TEXT
    dense, switchhead = made["paths"][presets[0]], made["paths"][presets[1]]
    with opened(made["page"]) as (page, seen):
        first = page.evaluate(SHOWN)
        labels = first["labels"]
        if task == "listops":
            ids = [listops.TOKEN_ID[label] for label in labels]
        else:  # the text the page was made from, shown byte by byte as the analysis labels it
            ids = text.encode(HOSTILE).tolist()
            assert labels == [text.decode_token(i) for i in ids]
        layer, head, dest = 3 if task == "listops" else 1, 1, len(labels) // 2
        ours, reference = observed(switchhead, ids), observed(dense, ids)

        # SwitchHead, one head: the row, the destination's O experts and every source's V experts
        page.select_option("#model", label=presets[1])
        page.select_option("#layer", str(layer))
        page.select_option("#head", str(head))
        shown = hover(page, dest)
        record = ours[layer]
        assert shown["dest"] == dest
        assert_row(shown["weights"], expected_row(record, head, dest))
        assert_choices(
            shown["dst"], expected_choices(record["dst_experts"][0], record["dst_gates"][0], dest, head)
        )
        for position, picked in enumerate(shown["src"]):
            assert_choices(
                picked, expected_choices(record["src_experts"][0], record["src_gates"][0], position, head)
            )
        # the comparison can fail: the next token's row, or another head's, is not what the page shows
        worst = max(
            (torch.tensor(shown["weights"]).double() - expected_row(record, h, d).double()).abs().max()
            for h, d in ((head, dest + 1), (0, dest))
        )
        assert worst > STEP

        # the maximum over heads, with dense's maximum beside it for the same token
        page.select_option("#head", "-1")
        page.check("#compare")
        page.select_option("#other", label=presets[0])
        shown = hover(page, dest - 1)
        assert_row(shown["weights"], expected_row(record, None, dest - 1))
        assert_row(shown["compare"], expected_row(reference[layer], None, dest - 1))
        assert_choices(
            shown["dst"], expected_choices(record["dst_experts"][0], record["dst_gates"][0], dest - 1, None)
        )

        if task == "listops":  # MoA: the heads (experts) each token chose and their weights
            moa = observed(made["paths"]["listops-moa-h4"], ids)[layer]
            page.select_option("#model", label="listops-moa-h4")
            shown = hover(page, dest)
            assert_row(shown["weights"], expected_row(moa, None, dest))
            assert_choices(
                shown["dst"],
                expected_choices(moa["experts"][0, ..., None], moa["gates"][0, ..., None], dest, None),
            )
            # MoH: every head's weight for this token (shared heads always on, k routed ones non-zero)
            moh = observed(made["paths"]["listops-moh-h8"], ids)[layer]
            weights = moh["head_weights"][0]  # [t, H]
            heads = torch.arange(weights.shape[-1]).expand_as(weights)
            page.select_option("#model", label="listops-moh-h8")
            shown = hover(page, dest)
            assert_row(shown["weights"], expected_row(moh, None, dest))
            assert_choices(shown["dst"], expected_choices(heads[..., None], weights[..., None], dest, None))
            assert "head 0: weight" in shown["panel"] and "slot" not in shown["panel"]
        page.select_option("#model", label=presets[0])
        shown = hover(page, 0)
        assert shown["dst"] == [] and "no experts" in shown["panel"]

        # the keyboard: a click pins, arrows move the pinned token, Escape releases it, Enter pins again
        page.click('#tokens .tok[data-pos="2"]')
        page.keyboard.press("ArrowRight")
        assert (hover(page, 6)["dest"], page.evaluate(SHOWN)["pinned"]) == (3, True)
        page.keyboard.press("Escape")
        assert hover(page, 5)["dest"] == 5  # another token than the last hovered: the mouse must move
        page.focus('#tokens .tok[data-pos="5"]')
        page.keyboard.press("Home")
        page.keyboard.press("Enter")
        assert (hover(page, 4)["dest"], page.evaluate(SHOWN)["pinned"]) == (0, True)
        assert_row(page.evaluate(SHOWN)["weights"], expected_row(reference[layer], None, 0))

        layout = page.evaluate("document.documentElement.scrollWidth")
        page.screenshot(path=str(tmp_path / "explorer.png"))
        requests = list(seen["requests"])
    assert requests == [made["page"].resolve().as_uri()]  # the page itself, nothing else
    assert seen["external"] == [] and seen["failed"] == [] and seen["errors"] == []
    assert layout <= WIDTH
