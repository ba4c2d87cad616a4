"""What relaying tokens costs the engine on a worker, measured in the same run.

The engine runs ``--streams`` (32) greedy requests at once, three ways, in turns (``--rounds``
each, interleaved so that a shared machine's changing load falls on all three alike):

- ``engine``: nothing relayed (each output is dropped by a listener): the baseline;
- ``thread_per_stream``: the way workers relayed before: a thread per request iterates its
  handle and sends each output to the reply channel, waiting for each send;
- ``step_relay``: the worker's ``StreamRelay``: the engine's listener queues each output and one
  sender thread sends a step's outputs together.

A reader in another process (a gateway, as far as Redis can tell) takes every message. Reported:
output tokens/s of each way (the median of its rounds) and each relay's ratio to the baseline.
Writes bench/results/relay-cpu.json. Not part of the tests.

    python bench/relay.py
    python bench/relay.py --streams 8 --rounds 2 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
RESULTS = REPO_ROOT / "bench" / "results"
WAYS = ("engine", "thread_per_stream", "step_relay")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32, help="concurrent requests (32)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way (3)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (64)")
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="the Redis the messages go through (REDIS_URL, else 127.0.0.1:6379)")
    parser.add_argument("--out", default=str(RESULTS / "relay-cpu.json"))
    return parser.parse_args(argv)


def layer(redis_url: str):
    from inference_platform.channel_layer import RedisChannelLayer

    # The socket timeout must outlast the layer's 5 s blocking pops, as in the settings.
    return RedisChannelLayer(hosts=[{"address": redis_url, "socket_timeout": 30}], capacity=10_000, expiry=120)


def reader(redis_url: str, requests, replies) -> None:
    """A gateway stand-in: for each batch of channels asked for, read every message until each
    channel's "end"; report how many messages came."""
    channels_layer = layer(redis_url)

    async def serve():
        while True:
            count = await asyncio.to_thread(requests.get)
            if count is None:
                return
            channels = [await channels_layer.new_channel() for _ in range(count)]
            replies.put(channels)

            async def drain(channel):
                received = 0
                while (await channels_layer.receive(channel))["type"] != "end":
                    received += 1
                return received

            replies.put(sum(await asyncio.gather(*(drain(c) for c in channels))))

    asyncio.run(serve())


def delta(out) -> dict:
    return {"type": "inference.delta", "text": out.text, "token_ids": out.token_ids}


def run_way(way: str, engine, prompts, params, channels, sender, relay) -> tuple[int, float]:
    """Run every prompt at once the given way; (output tokens, seconds)."""
    finals: list = [None] * len(prompts)
    started = time.perf_counter()
    if way == "engine":
        done = threading.Semaphore(0)

        def listener_for(i):
            def listen(out):
                if out.finished:
                    finals[i] = out
                    done.release()
            return listen

        for i, prompt in enumerate(prompts):
            engine.submit(prompt, params, listener=listener_for(i))
        for _ in prompts:
            done.acquire()
    elif way == "thread_per_stream":
        def relay_one(i):
            for out in engine.submit(prompts[i], params):
                if out.token_ids or out.text:
                    sender.send(channels[i], delta(out))
                finals[i] = out

        threads = [threading.Thread(target=relay_one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        streams = []
        for i, prompt in enumerate(prompts):
            stream = relay.stream(channels[i], delta)
            stream.handle = engine.submit(prompt, params, listener=stream)
            stream.open()
            streams.append(stream)
        finals = [stream.wait(600) for stream in streams]
    seconds = time.perf_counter() - started
    for channel in channels:
        sender.send(channel, {"type": "end"})
    return sum(out.completion_tokens for out in finals), seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.serving import prompts as make_prompts
    from workers.engine import Engine, SamplingParams, bundled_model_path
    from workers.relay import ChannelSender, StreamRelay

    requests, replies = multiprocessing.Queue(), multiprocessing.Queue()
    gateway = multiprocessing.Process(target=reader, args=(args.redis, requests, replies), daemon=True)
    gateway.start()
    sender = ChannelSender(layer(args.redis))
    relay = StreamRelay(sender)
    engine = Engine(bundled_model_path(), max_batch_size=args.streams, batch_window_ms=20).start()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    texts = make_prompts(args.streams, 60)
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        requests.put(args.streams)  # warm-up: one whole unrecorded run, so that no way pays for it
        run_way("engine", engine, texts, params, replies.get(timeout=60), sender, relay)
        replies.get(timeout=120)
        for round_no in range(args.rounds):
            for way in WAYS:
                requests.put(args.streams)
                channels = replies.get(timeout=60)
                tokens, seconds = run_way(way, engine, texts, params, channels, sender, relay)
                received = replies.get(timeout=120)
                rates[way].append(tokens / seconds)
                print(f"round {round_no + 1}/{args.rounds} {way:>17}: {tokens / seconds:8.1f} tok/s "
                      f"({received} messages read)", flush=True)
    finally:
        requests.put(None)
        relay.close()
        engine.stop()
        gateway.join(timeout=10)

    medians = {way: round(statistics.median(values), 2) for way, values in rates.items()}
    result = {
        "benchmark": "relay",
        "machine": {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "engine_dtype": str(engine.dtype).removeprefix("torch."),
        "workload": {"streams": args.streams, "max_tokens": args.max_tokens, "rounds": args.rounds},
        "output_tokens_per_s": medians,
        "runs": {way: [round(v, 2) for v in values] for way, values in rates.items()},
        "ratio_to_engine": {way: round(medians[way] / medians["engine"], 3) for way in WAYS[1:]},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratio_to_engine"]), f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
