"""The training engine: build (grid -> model -> data -> trainer), the one loop, precision, optimizer,
step results, watchdog, preemption, profiling and logging.
"""
