"""The process of one worker rank (:mod:`metrale.backends.executor`, ``distributed_executor_backend="mp"``):
``python -m metrale.backends.rank_worker`` reads its :class:`~metrale.backends.executor.WorkerSpec` and rank
(pickled) from its standard input and runs :func:`~metrale.backends.executor.worker_main`, exiting when
the driver that started it is gone."""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    spec, rank = pickle.loads(sys.stdin.buffer.read())
    from metrale.backends.executor import exit_with_parent, worker_main

    exit_with_parent(spec.driver_pid)
    worker_main(spec, rank)


if __name__ == "__main__":
    main()
