"""The official OpenAI Python SDK against a running pgw server.

Driven by tests/openai_sdk.rs (run through `cargo xtask test`, which installs `openai`
into a venv under target/). Usage:

    python openai_sdk.py BASE_URL KEY MODEL PROMPT JSON_MAX_TOKENS STREAM_MAX_TOKENS

Prints `FIRST` (flushed) the moment the streamed answer's first content chunk
arrives, then one JSON line with what the SDK saw. Any exception the SDK raises where
none is expected ends the script with a traceback and a non-zero status.
"""

import json
import sys

import openai


def main():
    base_url, key, model, prompt, json_max, stream_max = sys.argv[1:7]
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    out = {"sdk_version": openai.__version__}

    out["models"] = [m.id for m in client.models.list()]
    out["retrieved"] = client.models.retrieve(model).id
    try:
        client.models.retrieve("no-such-model")
        out["missing"] = "found"
    except openai.NotFoundError as e:
        out["missing"] = e.code

    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=int(json_max),
    )
    out["json_content"] = answer.choices[0].message.content
    out["json_finish_reason"] = answer.choices[0].finish_reason
    # The SDK's request id, read from the answer's `x-request-id`.
    out["json_request_id"] = answer._request_id

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=int(stream_max),
        stream=True,
    )
    parts = []
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                if not parts:
                    print("FIRST", flush=True)
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    out["stream_content"] = "".join(parts)
    out["stream_chunks"] = len(parts)
    out["stream_finish_reason"] = finish

    stranger = openai.OpenAI(base_url=base_url, api_key="sk-not-a-pgw-key", max_retries=0, timeout=60)
    try:
        stranger.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4
        )
        out["unknown_key"] = {"raised": None}
    except openai.AuthenticationError as e:
        out["unknown_key"] = {
            "raised": "AuthenticationError",
            "status": e.status_code,
            "code": e.code,
            "type": e.type,
            "message": e.message,
            "request_id": e.request_id,
        }

    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
