"""kv-router: routes requests to the engine where their prefix is cached; OpenAI HTTP front door."""
