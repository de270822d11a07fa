"""A remote environment server in plain grpcio: the smallest thing the environment service can forward to.

Task: the prompt asks to copy a digit; reward 1 when the answer's first non-blank character equals
metadata["ground_truth"]. Only Step is required of a remote environment.

    python examples/remote_env_server.py --port 7000      # prints "listening on 127.0.0.1:7000"
"""

import argparse
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the generated stubs, when run from anywhere
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2  # noqa: E402


class FirstCharEnvironment(environment_pb2_grpc.EnvironmentServiceServicer):
    def Step(self, request, context):
        results = []
        for episode in request.episodes:  # one result per episode, in order
            answer = episode.messages[-1].content.strip() if episode.messages else ""
            truth = str(episode.metadata["ground_truth"]) if "ground_truth" in episode.metadata else None
            correct = bool(answer) and answer[0] == truth
            results.append(environment_pb2.EpisodeResult(
                observation=types_pb2.ChatMessage(role="environment", content="correct" if correct else "wrong"),
                reward=1.0 if correct else 0.0, terminated=True, answer=answer[:1]))
        return environment_pb2.StepResponse(results=results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(FirstCharEnvironment(), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"listening on {args.host}:{port}", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    stopped.wait()
    server.stop(grace=1).wait()


if __name__ == "__main__":
    main()
