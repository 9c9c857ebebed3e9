"""Which training steps capture whole in one CUDA graph, and where a capture fails: one JSON line per case.

For each preset and attention backend, the eager step of `speed --cuda-graphs` is captured at a small batch; a
failure prints its message and the innermost frames of this project's code and of torch. SDPA runs twice, with
and without its cuDNN kernel, since which SDPA kernel runs is torch's choice per shape and device.

    python benchmarks/graph_capture_probe.py [--presets ...] [--batch 4]
"""

import argparse
import json
import traceback

import torch

from switchbench.bench.timing.benches import StepMode, model_benches, release_memory
from switchbench.ops.attention import choice as attention_choice


def probe(preset: str, attention: str, cudnn: bool, batch: int) -> dict:
    case = {"preset": preset, "attention": attention, "cudnn_sdpa": cudnn, "batch": batch}
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        with attention_choice.selected(attention):
            bench = model_benches(preset, batch, "cuda", torch.bfloat16, mode=StepMode(cuda_graphs=True))[0]
            bench.run()  # model_benches captured the step; this is one replay
            torch.cuda.synchronize()
        return case | {"captured": True}
    except Exception as error:  # a probe: every failure is the finding
        frames = traceback.extract_tb(error.__traceback__)
        ours = [
            f"{f.filename.split('switchbench/')[-1]}:{f.lineno} {f.line}"
            for f in frames
            if "switchbench" in f.filename
        ]
        return case | {
            "captured": False,
            "error": f"{type(error).__name__}: {str(error)[:300]}",
            "frames": ours[-4:],
            "innermost": [f"{f.filename}:{f.lineno} {f.line}" for f in frames[-2:]],
        }
    finally:
        release_memory()  # the case's graph and its pool let go


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["c4-47m-transformer-h10", "c4-47m-switchhead-h2"])
    parser.add_argument("--attention", nargs="+", default=["sdpa", "explicit"])
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    for preset in args.presets:
        for attention in args.attention:
            for cudnn in (True, False) if attention == "sdpa" else (True,):
                print(json.dumps(probe(preset, attention, cudnn, args.batch)), flush=True)


if __name__ == "__main__":
    main()
