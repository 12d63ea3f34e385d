import torch

# One thread: the tensors in the tests are small, and on a shared 2-core machine extra threads mostly
# contend (measured: 100 tiny forwards 6.8 s with 2 threads vs 0.09 s with 1 under load).
torch.set_num_threads(1)
