"""The code of docs/walkthrough.md: runs every step and saves its figures in a folder.

python examples/walkthrough.py                   # figures in ./walkthrough_plots/
python examples/walkthrough.py --out docs/img    # regenerate the figures shown in docs/walkthrough.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import smcdecode as sd  # noqa: E402
from smcdecode.potentials import JSONSchema, LMReward  # noqa: E402
from smcdecode.structured import generate_json  # noqa: E402
from smcdecode.testing import exact_autoregressive, exact_target, particle_distributions, total_variation  # noqa: E402


def step1_toy(out: Path) -> None:
    """A toy LM where every probability is known: global conditional vs local masking vs SMC."""
    print("## 1. A toy problem, solved exactly")
    vocab = ["<bos>", "{", '"a"', '"b"', ": ", ", ", "1", "2", "}", "<eos>"]
    table = 1.5 * torch.randn(len(vocab), len(vocab), generator=torch.Generator().manual_seed(3))
    toy = sd.FunctionModel(lambda ctx: table[ctx[:, -1]], vocab, name="toy-bigram")
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    target = sd.LM(toy) * JSONSchema(schema)
    exact = exact_target(target, [0], 10)
    local = exact_autoregressive(target, [0], 10)
    runs = {}
    for n in (1, 4, 16):
        res = sd.SMC(target, particles=n).run_groups([0], groups=2000, max_new_tokens=10, seed=0)
        dist: dict = {}
        for d in particle_distributions(res):
            for x, w in d.items():
                dist[x] = dist.get(x, 0.0) + w / 2000
        runs[n] = dist
    keys = sorted(exact.probs, key=lambda x: -exact.probs[x])
    labels = [toy.decode(list(x)) for x in keys]
    print(f"TV(locally masked, exact) = {total_variation(local.probs, exact.probs):.3f}")
    for n, d in runs.items():
        print(f"TV(SMC N={n} returned sample, exact) = {total_variation(d, exact.probs):.3f}")
    fig, ax = plt.subplots(figsize=(9, 3.4))
    width = 0.17
    series = [("exact p(x | valid)", exact.probs), ("locally masked", local.probs)] + [
        (f"SMC N={n}", d) for n, d in runs.items()
    ]
    for i, (name, d) in enumerate(series):
        ax.bar([k + (i - 2) * width for k in range(len(keys))], [d.get(x, 0.0) for x in keys], width, label=name)
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_ylabel("probability")
    ax.set_title("toy LM + JSON Schema: the distribution of the returned document")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "walkthrough_toy_distributions.png", dpi=110)
    plt.close(fig)
    for x in keys:
        print(
            f"  {toy.decode(list(x)):22s} exact {exact.probs[x]:.3f}  masked {local.probs.get(x, 0):.3f}  "
            + "  ".join(f"N={n} {d.get(x, 0):.3f}" for n, d in runs.items())
        )


def step2_regex(model, out: Path) -> None:
    print("\n## 2. A date format on SmolLM2")
    target = sd.LM(model, temperature=0.7) * sd.Regex(r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")
    messages = [{"role": "user", "content": "When did the Berlin Wall fall? Answer with the date as YYYY-MM-DD."}]
    result = sd.SMC(target, particles=8).run(messages, max_new_tokens=12, seed=0, progress=False)
    print(result.summary())
    result.plot(str(out / "walkthrough_regex.png"))


def step3_json(model, out: Path) -> None:
    print("\n## 3. JSON Schema on SmolLM2, parsed")
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genres": {
                "type": "array",
                "items": {"enum": ["drama", "comedy", "action", "science fiction"]},
                "maxItems": 2,
            },
        },
        "required": ["title", "year", "genres"],
        "additionalProperties": False,
    }
    res = generate_json(
        model, "Describe the film Star Wars (1977).", schema, particles=8, max_new_tokens=40, temperature=0.7, seed=0
    )
    print("value:", res.value)
    print(res.result.summary())
    res.result.plot(str(out / "walkthrough_json.png"))


def step4_rewards(model, out: Path) -> None:
    print("\n## 4. Reward-weighted decoding and a second prompt")
    question = [{"role": "user", "content": "Write one sentence about your favourite place."}]

    sea_words = ("sea", "ocean", "beach", "wave", "island", "coast")

    def sea_short(texts):  # +1 per sea word present, -0.01 per character
        return [sum(w in t.lower() for w in sea_words) - 0.01 * len(t) for t in texts]

    reward = sd.Reward(sea_short, beta=2.0, mode="prefix", batched=True, name="sea-words-short")
    result = sd.SMC(sd.LM(model, temperature=0.8) * reward, particles=8).run(
        question, max_new_tokens=24, seed=0, progress=False
    )
    print(result.summary())
    print("sample:", result.text)
    result.plot(str(out / "walkthrough_reward.png"))
    second = model.prompt_ids([{"role": "user", "content": "Write one sentence about the sea and sailing."}])
    target = sd.LM(model, temperature=0.8) * LMReward(model, second, beta=1.0)
    result = sd.SMC(target, particles=8).run(question, max_new_tokens=24, seed=0, progress=False)
    print(result.summary())
    print("sample:", result.text)
    result.plot(str(out / "walkthrough_prompt_intersection.png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("walkthrough_plots"), help="folder for the figures (default: ./walkthrough_plots)"
    )
    out = parser.parse_args().out
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    step1_toy(out)
    model = sd.load_model()
    step2_regex(model, out)
    step3_json(model, out)
    step4_rewards(model, out)
    print(f"\nfigures saved in {out}/")


if __name__ == "__main__":
    main()
