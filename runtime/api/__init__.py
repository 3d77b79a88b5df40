"""The HTTP API: OpenAI routes, network routes, metrics, the dashboard page."""
