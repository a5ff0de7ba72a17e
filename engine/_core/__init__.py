"""The core: the verifier contract, the scheduler, its meters and the batch's report."""
