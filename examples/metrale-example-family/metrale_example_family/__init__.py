"""An example Metrale model family: the parallel-residual decoder."""
