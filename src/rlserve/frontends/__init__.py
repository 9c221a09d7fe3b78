"""Several frontend processes over one engine: what they say to each other (`protocol`), the
leading frontend's end (`leader`) and a following frontend's lifecycle (`follower`)."""
