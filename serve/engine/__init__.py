"""The serving engine: requests, the host-only scheduler, the runner (pools and compiled programs), the
engine that ties them together, block allocation, sampling, and the engine on several processes."""
