"""A training script that knows nothing of gpuwatchd (tests/gpu/test_discovered_shapes.py): a small
model on the GPU, SGD for STEPS steps 0.1 s apart, then it stops stepping (sleeps) as a hung rank
would. Run under ``torchrun ... -m gpuwatchd.rank.run`` or with ``GPUWATCHD_HEARTBEAT=1`` where the
wheel is installed, it gets a rank file and heartbeats without a line changed.

usage: autobeat_train.py STEPS
"""

import sys
import time

import torch

net = torch.nn.Linear(256, 256).cuda()
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for _ in range(int(sys.argv[1])):
    opt.zero_grad()
    net(torch.randn(64, 256, device="cuda")).square().mean().backward()
    opt.step()
    time.sleep(0.1)
print(f"stepped; gpuwatchd imported: {'gpuwatchd' in sys.modules}", flush=True)
time.sleep(10**6)
