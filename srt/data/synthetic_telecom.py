"""The telecom domain of the synthetic corpus: an account number, the plan and its monthly fee, the
billing day and autopay card, and the data allowance a yes/no query needs.

draw_domain(rng, pair) returns what generate_dialogue (srt/data/synthetic.py) lays out: the
comment above srt/data/synthetic_common.Round says what each part is.
"""

from __future__ import annotations

from srt.data.synthetic_common import (
    CITIES,
    MONTHS,
    RECIPIENTS,
    QueryRound,
    QuerySpec,
    Round,
    SelfContained,
    _distinct,
    _pick,
    _self_contained,
)

PLANS = [
    "Unlimited Plus",
    "Basic Talk",
    "Family Share",
    "Value Saver",
    "Premium Max",
    "Starter Lite",
    "Data Flex",
    "Student Saver",
    "Global Roam",
    "Smart Choice",
    "Everyday Plus",
    "Talk and Text",
]
DEVICES = ["tablet", "laptop", "phone", "smart TV", "hotspot", "kid's phone", "car's wifi", "watch"]


def draw_domain(rng, pair):
    used = set()
    account, card = (_distinct(rng, lambda r: str(r.randrange(1000, 9999)), used) for _ in range(2))
    plan, new_plan = rng.sample(PLANS, 2)
    s = {"plan": plan, "fee": rng.randrange(15, 120)}
    new_fee = _distinct(rng, lambda r: r.randrange(15, 120), {s["fee"]})
    over, usage, data_gb = pair.yes_no(rng, "telecom")
    place, month = _pick(rng, CITIES), _pick(rng, MONTHS)
    bill_day = rng.randrange(1, 29)
    facts = [
        Round(
            _pick(
                rng, [f"Hi, my account number ends in {account}.", f"Hello, account ending {account} here."]
            ),
            _pick(
                rng,
                [
                    "Thanks, I've verified your account.",
                    "Got it, your account is open.",
                    "Thank you, I can see your account now.",
                ],
            ),
            {"account": "Q"},
        ),
        Round(
            _pick(
                rng,
                ["Which plan am I on?", "Can you check my current plan?", "What plan do I have right now?"],
            ),
            _pick(
                rng,
                [
                    f"You're on the {plan} plan at ${s['fee']} per month.",
                    f"Your plan is {plan}, which costs ${s['fee']} a month.",
                ],
            ),
            {"plan": "A"},
        ),
        Round(
            _pick(
                rng,
                ["How much data do I get?", "What's my data allowance?", "How much mobile data is included?"],
            ),
            _pick(
                rng,
                [f"Your plan includes {data_gb} GB of data each month.", f"You get {data_gb} GB per month."],
            ),
            {"data": "A"},
        ),
        Round(
            _pick(
                rng,
                ["When is my bill issued?", "What day do I get billed?", "When does my billing cycle start?"],
            ),
            _pick(
                rng,
                [
                    f"Your bill is issued on day {bill_day} of each month.",
                    f"Billing happens on day {bill_day} every month.",
                ],
            ),
            {"bill_day": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"Please use my card ending in {card} for autopay.",
                    f"I want autopay on the card ending {card}.",
                ],
            ),
            _pick(rng, ["Done, autopay is set up.", "Autopay is now active.", "All set, autopay is on."]),
            {"card": "Q"},
        ),
    ]
    updates = {
        "plan": Round(
            _pick(rng, [f"I'd like to switch to the {new_plan} plan.", f"Can you move me to {new_plan}?"]),
            _pick(
                rng,
                [
                    f"Done. You're now on {new_plan} at ${new_fee} per month.",
                    f"I've switched you to {new_plan}; it costs ${new_fee} a month.",
                ],
            ),
            {"plan": "A"},
            apply=lambda st: st.update(plan=new_plan, fee=new_fee),
            kind="update",
        )
    }

    def over_limit(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"If I use {usage} GB in {month}, will I go over?",
                    f"Would {usage} GB in {month} exceed my allowance?",
                    f"I'll probably stream about {usage} GB of video in {month}. Is that more than my plan "
                    "includes?",
                    f"My trip to {place} in {month} could take {usage} GB of data. Would that put me over my "
                    "allowance?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"{'Yes' if over else 'No'}. Your allowance is {data_gb} GB a month, so {usage} GB in "
                    f"{month} {'goes over it' if over else 'stays within it'}.",
                    f"{'Yes' if over else 'No'}. {usage} GB is {'more' if over else 'not more'} than the "
                    f"{data_gb} GB your plan includes for {month}.",
                ],
            ),
            answer_keys=["yes" if over else "no"],
            analysis="whether their planned usage exceeds the data allowance",
            reasoning=f"The allowance is {data_gb} GB and the user plans {usage} GB.",
            derived_yes_no=True,
        )

    about_bill = [
        ("My bills always seem to come at a bad time.", "Many customers feel that way about bills."),
        ("I'm trying to get my monthly budget in order.", "A clear budget really helps."),
    ]

    def ask_account(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "Which account number did I give you?",
                    "What are the last digits of my account again?",
                    "Sorry, which account did I say this was?",
                    "Can you read my account number back to me?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"Your account number ends in {account}.",
                    f"It's the account ending in {account}.",
                    f"You gave the account ending {account}.",
                ],
            ),
            answer_keys=[account],
            analysis="for their account number",
            reasoning=f"The user said the account ends in {account}.",
            derived_yes_no=False,
        )

    def ask_plan(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "How much do I pay per month now?",
                    "What's my monthly fee at the moment?",
                    "So what will my monthly bill be from now on?",
                    "Remind me what my plan costs each month now?",
                    f"What will I be paying for my plan in {month}?",
                    f"I'm planning my budget for {month}. What's my monthly fee?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"You're on {st['plan']} at ${st['fee']} per month.",
                    f"Your {st['plan']} plan costs ${st['fee']} a month.",
                    f"It's ${st['fee']} a month, for {st['plan']}.",
                ],
            ),
            answer_keys=[f"${st['fee']}"],
            analysis="for their current monthly fee",
            reasoning=f"The latest plan is {st['plan']} at ${st['fee']} per month; it replaces the "
            "earlier plan.",
            derived_yes_no=False,
        )

    def ask_bill_day_and_card(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "When am I billed and which card pays it?",
                    "Remind me of my billing day and the autopay card?",
                ],
            ),
            answer=f"You're billed on day {bill_day}, paid by the card ending in {card}.",
            answer_keys=[f"day {bill_day}", card],
            analysis="for the billing day and the autopay card",
            reasoning=f"Billing is on day {bill_day}; autopay uses the card ending {card}.",
            derived_yes_no=False,
        )

    def ask_account_and_bill_day(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "Confirm my account and billing day, please.",
                    "What's my account number and my billing day?",
                ],
            ),
            answer=f"Account ending {account}, billed on day {bill_day}.",
            answer_keys=[account, f"day {bill_day}"],
            analysis="for the account number and the billing day",
            reasoning=f"The account ends in {account}; billing is on day {bill_day}.",
            derived_yes_no=False,
        )

    queries = [
        QuerySpec(
            "single",
            ["account"],
            "your account number",
            ask_account,
            [("I have so many accounts I can't keep them straight.", "It's easy to mix them up.")],
        ),
        QuerySpec(
            "update",
            ["plan"],
            "your monthly fee",
            ask_plan,
            about_bill,
        ),
        QuerySpec(
            "pair",
            ["bill_day", "card"],
            "your billing day and autopay card",
            ask_bill_day_and_card,
            about_bill,
        ),
        QuerySpec(
            "single",
            ["data"],
            "your data allowance",
            over_limit,
            [
                ("I stream a lot of videos on my phone.", "Video can use a lot of mobile data."),
                ("I'll be travelling a lot this month.", "Maps and video on the road add up quickly."),
            ],
        ),
        QuerySpec(
            "pair",
            ["account", "bill_day"],
            "your account number and billing day",
            ask_account_and_bill_day,
            about_bill,
        ),
    ]
    services = [
        ("Do you have 5G coverage?", "Yes, 5G covers all major cities on our network."),
        ("Can I keep my number if I switch?", "Yes, number transfer is free."),
        ("Is there a contract?", "No, all our plans are month to month."),
        ("Do you sell phones?", "Yes, we sell phones with monthly payment options."),
        ("Can I use my phone abroad?", "Yes, roaming works in most countries."),
        ("Do you offer home internet?", "Yes, we offer fibre home internet in many areas."),
    ]

    def months_total(r):
        n, fee, who = r.randrange(2, 13), r.randrange(10, 100), _pick(r, RECIPIENTS)
        total = n * fee
        return _self_contained(
            f"what {n} months at ${fee} a month cost",
            f"{n} x ${fee} = ${total}.",
            _pick(
                r,
                [
                    f"If a plan costs ${fee} a month, what do {n} months come to?",
                    f"What would I pay over {n} months for a ${fee} monthly plan?",
                    f"I'm paying for a ${fee} a month plan for {who} for {n} months. What's that in total?",
                ],
            ),
            _pick(r, [f"{n} months at ${fee} come to ${total}.", f"That's ${total} over {n} months."]),
            [f"${total}"],
        )

    def instalment(r):
        n, monthly = _pick(r, [6, 10, 12, 18, 24, 36]), r.randrange(9, 80)
        product = _pick(r, ["phone", "tablet", "smartwatch", "laptop", "games console", "router"])
        price = n * monthly
        return _self_contained(
            f"the monthly payment for a ${price} {product} over {n} months",
            f"${price} / {n} = ${monthly}.",
            _pick(
                r,
                [
                    f"If I pay off a ${price} {product} over {n} months, how much is that each month?",
                    f"A ${price} {product} split into {n} equal monthly payments: what is each payment?",
                ],
            ),
            _pick(r, [f"That's ${monthly} a month.", f"Each payment would be ${monthly}."]),
            [f"${monthly}"],
        )

    def weekly_data(r):
        device, per_week, weeks = _pick(r, DEVICES), r.randrange(2, 31), r.randrange(2, 9)
        total = per_week * weeks
        return _self_contained(
            f"how much data {per_week} GB a week adds up to over {weeks} weeks",
            f"{per_week} GB x {weeks} = {total} GB.",
            _pick(
                r,
                [
                    f"If my {device} uses {per_week} GB a week, how much is that over {weeks} weeks?",
                    f"My {device} uses about {per_week} GB a week. What's that for {weeks} weeks?",
                ],
            ),
            _pick(
                r,
                [f"That's {total} GB in total.", f"Over {weeks} weeks your {device} would use {total} GB."],
            ),
            [f"{total} GB"],
        )

    def call_minutes(r):
        calls, minutes = r.randrange(2, 12), r.randrange(5, 45)
        total = calls * minutes
        return _self_contained(
            f"how many minutes {calls} calls of {minutes} minutes make",
            f"{calls} x {minutes} = {total} minutes.",
            _pick(
                r,
                [
                    f"I made {calls} calls of {minutes} minutes each. How many minutes is that?",
                    f"If I have {calls} calls a week of about {minutes} minutes, how many minutes is that "
                    "a week?",
                ],
            ),
            _pick(
                r, [f"That's {total} minutes.", f"{calls} calls of {minutes} minutes make {total} minutes."]
            ),
            [f"{total} minutes"],
        )

    self_contained = [
        SelfContained(
            "what a monthly plan costs over several months",
            months_total,
            [("I'm trying to get my yearly budget in order.", "A clear budget really helps.")],
        ),
        SelfContained(
            "monthly payments for a new device",
            instalment,
            [("My phone screen cracked last week.", "That's annoying; a new phone might be due.")],
        ),
        SelfContained(
            "how much data you use over a few weeks",
            weekly_data,
            [("I watch a lot of shows on my tablet.", "Streaming can use a lot of data.")],
        ),
        SelfContained(
            "how many minutes your calls add up to",
            call_minutes,
            [("I spend a lot of time on the phone for work.", "Work calls really add up.")],
        ),
    ]
    protected = [account, card, f"${s['fee']}", f"${new_fee}", f"day {bill_day}"]
    return "telecom", s, facts, updates, queries, self_contained, services, protected
