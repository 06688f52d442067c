"""Where the ops run: the backend interface and the CPU backend (:mod:`metrale.backends.base`),
the CUDA backend (:mod:`metrale.backends.cuda`), tensor and expert parallelism
(:mod:`metrale.backends.parallel`) and the ranks that run it in processes of their own
(:mod:`metrale.backends.executor`, :mod:`metrale.backends.rank_worker`)."""
