"""Submit a remote environment to a running job, with an inline dataset and a mixing weight.

    python examples/remote_env_server.py --port 7000 &
    python examples/submit_env.py --controller 127.0.0.1:50051 --address 127.0.0.1:7000 --name first_char

It joins the mix at the controller's next lease. `flywheel env list` shows it; `flywheel env remove first_char`
takes it out again.
"""

import argparse
import asyncio
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.common.pb.flywheel.v1 import controller_pb2, types_pb2  # noqa: E402
from services.controller.client import ControllerClient  # noqa: E402


def dataset(count: int) -> list[types_pb2.DatasetRow]:
    """Prompts "copy d" with ground truth d, the task examples/remote_env_server.py scores."""
    rows = []
    for i in range(count):
        row = types_pb2.DatasetRow(messages=[types_pb2.ChatMessage(role="user", content=f"copy {i % 5}")])
        row.metadata.update({"ground_truth": str(i % 5)})
        rows.append(row)
    return rows


async def submit(args) -> int:
    client = ControllerClient(args.controller, token=args.token)
    try:
        spec = controller_pb2.EnvironmentSpec(
            name=args.name, address=args.address, rows=dataset(args.prompts), weight=args.weight,
            max_turns=1, reward_scale=1.0, timeout_seconds=5.0,
            sampling=types_pb2.SamplingParams(max_new_tokens=2))
        response = await client.submit(spec)
        print(f"submitted {args.name}: {response.num_prompts} prompts, weight {args.weight:g}", flush=True)
        for env in await client.list():
            print(f"  {env.spec.name:<16} weight {env.spec.weight:<5g} {env.spec.kind or env.spec.address}")
    finally:
        await client.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--controller", default="127.0.0.1:50051", help="controller address host:port")
    parser.add_argument("--address", required=True, help="host:port of the remote environment server")
    parser.add_argument("--name", default="first_char")
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=50, help="rows in the inline dataset")
    parser.add_argument("--token", default="", help="bearer token, where controller.auth_token is set")
    args = parser.parse_args()
    try:
        return asyncio.run(submit(args))
    except grpc.aio.AioRpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
