"""The worker's schedulers, behind one protocol (`base.Scheduler`), and its FIFO of jobs.

`exclusive` runs a generation alone through `model.generate`; `batched` runs generations
together on the backend's `BatchRunner` and owns the batch's step; `embedding` runs an embedding
model's requests together in as few forward passes as fit. `fifo.Fifo` holds the jobs in arrival
order and is the one place a scheduler waits for more of them, on the worker's clock.
"""
