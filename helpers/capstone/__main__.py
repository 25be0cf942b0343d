"""`make train`, or `python -m helpers.capstone`: the capstone's longer run, under torchrun.

    python -m helpers.capstone                  train (or go on training) in runs/capstone
    python -m helpers.capstone --fresh          start again from the first step
    python -m helpers.capstone --steps 1200     a longer run (a new schedule: use --fresh)
    python -m helpers.capstone --kill-rank 3 --kill-after 5    a rank killed: the run fails

A run that does not finish says why and how to go on, and exits non-zero: 130 after Ctrl-C,
torchrun's code after a failure.

4 ranks on this machine (dp 2 x tp 2), the recipe of `TRAINED` below: 10 minutes on the 2 CPU
cores of its committed record (trained.json); elsewhere, 600 times the step lesson 14 times. A
progress line shows the step, the loss, the validation loss and the time left. Ctrl-C stops it
between two steps, after a checkpoint; the same command goes on from there. At the end it writes
the loss curve (loss.svg) and a sample of what the model writes (sample.txt), and prints the
sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import torch

from helpers.capstone.job import arguments_for, records
from helpers.capstone.train import Config
from helpers.checkpoints_and_failures.elastic import (
    FINAL_FILE,
    torchrun_command,
    torchrun_environment,
)

# The longer run: the lesson's recipe, for 600 steps of 32 sequences of 256 bytes. Its 19,200
# windows of 257 bytes, at random offsets, draw 1.15 times the training text (4,284,864 bytes on
# Python 3.11.7), yet miss a given byte with probability (1 - 257 / 4,284,864) ** 19,200 = 0.32:
# the model sees about 68 % of the text, some of it more than once.
TRAINED = Config(batch=32, steps=600, warmup=30, lr=1e-2, save_every=50, eval_every=50)
DIRECTORY = "runs/capstone"
PROMPT = b"def "


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--directory", default=DIRECTORY)
    parser.add_argument("--steps", type=int, default=TRAINED.steps)
    parser.add_argument("--warmup", type=int, default=TRAINED.warmup,
                        help="steps of the learning rate's linear warmup")
    parser.add_argument("--fresh", action="store_true", help="remove the run's checkpoints first")
    parser.add_argument("--record", action="store_true", help="write the finished run's record "
                        "to helpers/capstone/trained.json (what README and the key figure show)")
    parser.add_argument("--kill-rank", type=int, help="a failure, made to happen: this rank is "
                        "killed (SIGKILL) after step --kill-after")
    parser.add_argument("--kill-after", type=int)
    options = parser.parse_args(argv)
    if (options.kill_rank is None) != (options.kill_after is None):
        parser.error("--kill-rank and --kill-after go together")
    config = dataclasses.replace(TRAINED, steps=options.steps, warmup=options.warmup)
    config.check()
    if options.fresh and os.path.isdir(options.directory):
        shutil.rmtree(options.directory)
    os.makedirs(options.directory, exist_ok=True)
    kill = ([] if options.kill_rank is None else
            ["--kill-rank", str(options.kill_rank), "--kill-after", str(options.kill_after)])
    command = torchrun_command("helpers.capstone.job",
                               [options.directory, *arguments_for(config), "--progress", *kill],
                               options.directory, nproc=config.ranks, max_restarts=0)
    environment = {**torchrun_environment(), "LOGLEVEL": "WARNING"}  # the progress line only
    returncode, interrupted, failed = run_torchrun(command, environment)
    if returncode != 0:
        return said_why(returncode, interrupted, failed, options.directory)
    final = os.path.join(options.directory, FINAL_FILE)
    config = torch.load(final, weights_only=False).config
    steps, validation = records(options.directory)
    text = finish(config, steps, validation, options.directory)
    if options.record:
        if max(steps) < config.steps:
            print("not recorded: the run has not finished", file=sys.stderr)
            return 1
        record(config, steps, validation, text)
    return 0


def run_torchrun(command: list, environment: dict) -> tuple:
    """Run torchrun and return (its exit code, whether Ctrl-C stopped it, the rank torchrun names
    as the root cause of a failure or None). Ctrl-C reaches this process and torchrun (its
    workers run in sessions of their own); torchrun's agent sends it on to every worker, which
    saves and leaves (job.py), and this one waits for them. The agent then raises
    SignalException, whose traceback says nothing after a Ctrl-C: it is left out, and every other
    line of torchrun's own goes through."""
    interrupted, found = [], {}
    signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    process = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True,
                               errors="replace", bufsize=1)
    reader = threading.Thread(target=_pass_on, args=(process.stderr, interrupted, found),
                              daemon=True)
    reader.start()
    returncode = process.wait()
    reader.join(5)  # (a worker torchrun left behind may hold its pipe open: not forever)
    return returncode, bool(interrupted), found.get("rank")


def _pass_on(stderr, interrupted: list, found: dict) -> None:
    """torchrun's standard error, line by line, to this one's, but a traceback that ends in
    SignalException after a Ctrl-C; the rank its failure report names as the root cause goes in
    found["rank"]."""
    held, root_cause = [], False  # a traceback, held until its last line says what it was
    for line in stderr:
        root_cause = root_cause or line.startswith("Root Cause")
        rank = re.match(r"\s*rank\s*:\s*(\d+)", line)
        if root_cause and rank and "rank" not in found:
            found["rank"] = int(rank.group(1))
        if held or line.startswith("Traceback (most recent call last)"):
            held.append(line)
            if line[:1].strip() and not line.startswith("Traceback"):  # the exception's line
                if not (interrupted and "SignalException" in line):
                    sys.stderr.writelines(held)
                held = []
            continue
        sys.stderr.write(line)
    sys.stderr.writelines(held)


def said_why(returncode: int, interrupted: bool, failed, directory) -> int:
    """What a run that did not finish says, and the exit code `make train` ends with: 130
    after Ctrl-C (a shell's code for SIGINT), else torchrun's, never 0."""
    from helpers.checkpoints_and_failures.resume import latest_checkpoint

    path, step = latest_checkpoint(directory)
    go_on = (f"its newest checkpoint is step {step}, in {directory}: `make train` goes on from "
             "it" if path is not None else f"no checkpoint in {directory} yet: `make train` "
             "starts from the first step")
    if interrupted:
        print(f"\nstopped by Ctrl-C; {go_on}.", file=sys.stderr)
        return 130
    who = f"rank {failed} failed (torchrun's report is above)" if failed is not None else (
        "torchrun failed (its report is above)")
    print(f"\nthe run did not finish: {who}, and torchrun ended with exit code {returncode}; "
          f"{go_on} (`make train ARGS=--fresh` starts over).", file=sys.stderr)
    return returncode if returncode > 0 else 1


def finish(config, steps: dict, validation: dict, directory) -> bytes:
    """The loss curve (loss.svg) and a sample (sample.txt) from the newest checkpoint."""
    from helpers.capstone import plots, sample

    figure = plots.plot_run({"4 ranks, dp 2 x tp 2": (steps, validation)}, baselines(config)[0])
    figure.savefig(os.path.join(directory, "loss.svg"))
    weights = sample.weights_from_checkpoint(directory, config)
    text = sample.generate(weights, config, PROMPT, length=400, seed=0)
    with open(os.path.join(directory, "sample.txt"), "wb") as out:
        out.write(text)
    print(f"\nthe loss curve: {directory}/loss.svg; what the model writes after {PROMPT!r} "
          f"({directory}/sample.txt):\n")
    print(text.decode("utf-8", errors="replace"))
    return text


def baselines(config) -> tuple:
    """The unigram baseline in bits per byte: on the held-out windows the run's validation loss
    is measured on (what its curve is compared with), and on the whole held-out text."""
    from helpers.capstone.corpus import python_source, unigram_bits
    from helpers.capstone.train import validation_windows

    corpus = python_source()
    return unigram_bits(corpus, validation_windows(corpus, config)), unigram_bits(corpus)


def record(config, steps: dict, validation: dict, text: bytes) -> None:
    """helpers/capstone/trained.json: what this run did, where and with what."""
    import json
    import platform

    from helpers.capstone.plots import TRAINED_FILE
    from helpers.llama import Llama

    scored, text_bits = baselines(config)
    with open(TRAINED_FILE, "w") as out:
        json.dump({"command": "make train (python -m helpers.capstone --fresh --record)",
                   "config": dataclasses.asdict(config),
                   "parameters": sum(p.numel() for p in Llama(config.shape).parameters()),
                   "machine": f"{cpu_model()}, {os.cpu_count()} cores",
                   "python": platform.python_version(), "torch": torch.__version__,
                   "unigram_bits": scored, "unigram_bits_text": text_bits,
                   "prompt": PROMPT.decode(),
                   "sample": text.decode("utf-8", errors="replace"),
                   "steps": steps, "validation": validation}, out, indent=1)
        out.write("\n")


def cpu_model() -> str:
    """The CPU's model name, as Linux reports it (/proc/cpuinfo), or the machine's type."""
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
