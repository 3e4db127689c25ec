"""neuron_dist: a topology-aware torch.distributed backend ("neuron") for Trainium-style clusters."""
