"""The trainer SDK: what runs in the trainer's process. Clients, the weight sync to one server
(`weight_sync`) and to many (`fleet/`), the transports' trainer halves (`senders`), what to send
(`plan`), servers started as child processes (`launch`) or Ray actors (`ray`). It imports the
shared formats (`rlserve.wire`), the generated API and the vocabulary, never server or worker
code."""
