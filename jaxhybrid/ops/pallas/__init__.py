"""Pallas kernels for accelerators, each beside the reference in jaxhybrid/ops that it equals."""
