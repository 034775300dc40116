"""An elastic training program, as Horovod users write it: `elastic_train.py EPOCHS BATCHES PAUSE`.

Every batch prints `progress <rank> <host> <epoch> <batch> <pid>` (the test kills or adds hosts
by these); the end prints one JSON line per rank: its generation's size, the optimizer steps,
the committed batches and the parameters.
"""
import json
import socket
import sys
import time

import torch

import mtrain.torch as hvd

epochs, batches, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(5, 3)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())


@hvd.elastic.run
def train(state):
    while state.epoch < epochs:
        while state.batch < batches:
            # Data depend on the batch and the rank's place in this generation, never on time.
            generator = torch.Generator().manual_seed(1000 * state.epoch + 10 * state.batch + hvd.rank())
            inputs, targets = torch.randn(6, 5, generator=generator), torch.randn(6, 3, generator=generator)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            state.steps += 1
            state.done.append([state.epoch, state.batch])
            print(f"progress {hvd.rank()} {socket.gethostname()} {state.epoch} {state.batch} "
                  f"{__import__('os').getpid()}", flush=True)
            state.batch += 1
            if state.batch % 2 == 0:
                state.commit()
            time.sleep(pause)
        state.batch = 0
        state.epoch += 1
        state.commit()


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0, steps=0, done=[])
train(state)
print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(), "steps": state.steps,
                  "done": state.done, "params": [p.detach().double().flatten().tolist() for p in model.parameters()]}),
      flush=True)
