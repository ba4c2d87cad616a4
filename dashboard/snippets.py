"""Copy-paste examples for calling a deployment, filled in with this platform's address."""

from __future__ import annotations

import json

KEY_VARIABLE = "INFERENCE_API_KEY"


def endpoints(request) -> dict:
    """The OpenAI-compatible base URL and the WebSocket URL as the user's browser reaches them."""
    base = request.build_absolute_uri("/").rstrip("/")
    ws_base = ("wss://" if base.startswith("https://") else "ws://") + base.split("://", 1)[1]
    return {"base_url": f"{base}/v1", "ws_url": f"{ws_base}/v1/ws"}


def examples(*, base_url: str, ws_url: str, model: str) -> dict[str, str]:
    """{"curl", "python", "websocket"}: the same chat request three ways; and "embeddings"."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Write a haiku about GPUs."}],
                       "max_tokens": 128, "stream": False}, indent=2)
    curl = (
        f"curl {base_url}/chat/completions \\\n"
        f"  -H \"Authorization: Bearer ${KEY_VARIABLE}\" \\\n"
        f"  -H \"Content-Type: application/json\" \\\n"
        f"  -d '{body}'"
    )
    python = f'''import os
from openai import OpenAI

client = OpenAI(
    base_url="{base_url}",
    api_key=os.environ["{KEY_VARIABLE}"],
)

stream = client.chat.completions.create(
    model="{model}",
    messages=[{{"role": "user", "content": "Write a haiku about GPUs."}}],
    max_tokens=128,
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()'''
    websocket = f'''import asyncio, json, os
import websockets  # pip install websockets

async def main():
    headers = {{"Authorization": f"Bearer {{os.environ['{KEY_VARIABLE}']}}"}}
    async with websockets.connect("{ws_url}", additional_headers=headers) as ws:
        await ws.send(json.dumps({{
            "request_id": "r1",
            "endpoint": "chat.completions",
            "model": "{model}",
            "messages": [{{"role": "user", "content": "Write a haiku about GPUs."}}],
            "max_tokens": 128,
            "stream": True,
        }}))
        # To stop early: await ws.send(json.dumps({{"type": "cancel", "request_id": "r1"}}))
        async for frame in ws:
            message = json.loads(frame)
            if message.get("type") == "error":
                raise RuntimeError(message["error"]["message"])
            if message.get("type") == "done":
                break
            for choice in message.get("choices", []):
                print(choice["delta"].get("content") or "", end="", flush=True)
    print()

asyncio.run(main())'''
    embeddings = f'''import os
from openai import OpenAI

client = OpenAI(
    base_url="{base_url}",
    api_key=os.environ["{KEY_VARIABLE}"],
)

texts = ["GPUs run matrix multiplications.", "The sea is calm tonight."]
reply = client.embeddings.create(model="{model}", input=texts)
for text, item in zip(texts, reply.data):
    print(len(item.embedding), text)  # one unit-length vector per text
print(reply.usage.prompt_tokens, "tokens")'''
    return {"curl": curl, "python": python, "websocket": websocket, "embeddings": embeddings}
