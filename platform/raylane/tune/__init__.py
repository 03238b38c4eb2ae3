"""The parallelism planner: Ray Tune searches layouts on measured throughput."""
