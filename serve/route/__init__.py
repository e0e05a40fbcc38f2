"""`jaxhybrid route`: an OpenAI-compatible front over several replicas that sends each request to where
its state is."""
