"""The shop domain of the synthetic corpus: orders, their numbers, items and prices, delivery
addresses and dates, and the return window a yes/no query needs.

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

ITEMS = [
    "wireless headphones",
    "coffee grinder",
    "yoga mat",
    "desk lamp",
    "hiking backpack",
    "blender",
    "smartwatch",
    "rain jacket",
    "air fryer",
    "bookshelf",
    "espresso machine",
    "standing desk",
    "robot vacuum",
    "electric kettle",
    "office chair",
    "camping tent",
]
STREETS = ["Maple", "Cedar", "Harbor", "Elm", "Willow", "Sunset", "Oak", "Lincoln", "Park", "River"]


def draw_domain(rng, pair):
    used = set()
    order = str(rng.randrange(10000, 99999))
    item_a, item_b = rng.sample(ITEMS, 2)
    price_a = _distinct(rng, lambda r: r.randrange(15, 400), used)
    price_b = _distinct(rng, lambda r: r.randrange(15, 400), used)
    address = f"{rng.randrange(2, 999)} {_pick(rng, STREETS)} Street, {_pick(rng, CITIES)}"
    ok, days_since, window = pair.yes_no(rng, "shop")
    s = {"date": f"{_pick(rng, MONTHS)} {rng.randrange(1, 29)}"}
    new_date = _distinct(rng, lambda r: f"{_pick(r, MONTHS)} {r.randrange(1, 29)}", {s["date"]})
    facts = [
        Round(
            _pick(
                rng,
                [
                    f"Hi, I'm calling about order #{order}.",
                    f"My order number is {order}.",
                    f"Hello, I have a question about my order, number {order}.",
                ],
            ),
            _pick(
                rng,
                [
                    "Thanks, I've pulled up your order.",
                    "Sure, I have the order in front of me.",
                    "Got it, the order is open on my screen.",
                    "Thank you, I can see that order now.",
                ],
            ),
            {"order": "Q"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"I bought the {item_a} for ${price_a}.",
                    f"It has the {item_a}, which was ${price_a}.",
                    f"The {item_a} I paid ${price_a} for is on it.",
                ],
            ),
            _pick(
                rng,
                [
                    f"I see the {item_a} on the order.",
                    f"Yes, the {item_a} is listed.",
                    f"Right, the {item_a} is there.",
                ],
            ),
            {"price_a": "Q"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"There's also a {item_b} at ${price_b} on it.",
                    f"I also added the {item_b} for ${price_b}.",
                ],
            ),
            _pick(rng, [f"Yes, the {item_b} is on the same order.", f"I see the {item_b} as well."]),
            {"price_b": "Q"},
        ),
        Round(
            _pick(
                rng,
                [
                    "Where is it being shipped?",
                    "Can you confirm the delivery address?",
                    "Which address do you have for delivery?",
                ],
            ),
            _pick(rng, [f"It's shipping to {address}.", f"The delivery address on file is {address}."]),
            {"address": "A"},
        ),
        Round(
            _pick(
                rng, ["When should it arrive?", "What's the delivery date?", "When can I expect the package?"]
            ),
            _pick(rng, [f"It is scheduled to arrive on {s['date']}.", f"Expected delivery is {s['date']}."]),
            {"delivery": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    "What's your return policy?",
                    "How long do I have to return something?",
                    f"If the {item_a} doesn't work out, can I send it back?",
                ],
            ),
            _pick(
                rng,
                [
                    f"You can return items within {window} days of delivery for a full refund.",
                    f"Returns are accepted up to {window} days after delivery, with a full refund.",
                ],
            ),
            {"window": "A"},
        ),
    ]
    updates = {
        "delivery": Round(
            _pick(rng, ["Is there any update on the shipment?", "Has anything changed with the delivery?"]),
            _pick(
                rng,
                [
                    f"Yes, the carrier moved your delivery to {new_date}.",
                    f"Update: it will now arrive on {new_date}.",
                ],
            ),
            {"delivery": "A"},
            apply=lambda st: st.update(date=new_date),
            kind="update",
        )
    }

    def can_return(st):
        answer = (
            f"Yes. {days_since} days is within the {window}-day window, so you would get back ${price_a}."
            if ok
            else f"No. {days_since} days is past the {window}-day return window, so the ${price_a} "
            "cannot be refunded."
        )
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"It's been {days_since} days since delivery. Can I still return the {item_a} "
                    "for a full refund?",
                    f"If I send the {item_a} back now, {days_since} days after delivery, do I get "
                    "my money back?",
                    f"The {item_a} arrived {days_since} days ago. Can I still send it back for a refund?",
                ],
            ),
            answer=answer,
            answer_keys=["yes" if ok else "no", f"${price_a}"],
            analysis=f"whether the {item_a} can still be returned for a refund",
            reasoning=f"The return window is {window} days and it has been {days_since} days; the "
            f"{item_a} cost ${price_a}.",
            derived_yes_no=True,
        )

    about_order = [
        ("I've been waiting for this package all week.", "I understand, waiting is never fun."),
        ("This is the first time I've ordered from you.", "Thanks for choosing us for your order."),
    ]

    def ask_order(st):
        return QueryRound(
            query=_pick(rng, ["What was my order number again?", "Can you remind me of my order number?"]),
            answer=f"Your order number is {order}.",
            answer_keys=[order],
            analysis="for their order number",
            reasoning=f"The user gave the order number earlier: {order}.",
            derived_yes_no=False,
        )

    def ask_address(st):
        return QueryRound(
            query=_pick(rng, ["Where is the package going?", "Which address will it be delivered to?"]),
            answer=f"It is going to {address}.",
            answer_keys=[address],
            analysis="for the delivery address",
            reasoning=f"The delivery address on file is {address}.",
            derived_yes_no=False,
        )

    def ask_delivery(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "So when will it arrive?",
                    "What's the latest delivery date?",
                    "When will my package get here, then?",
                    "So what day does the delivery come?",
                    "When can I expect the package now?",
                    "I need to be home for the delivery. Which day is it?",
                    "What date is the delivery set for now?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"It should arrive on {st['date']}.",
                    f"The latest delivery date is {st['date']}.",
                    f"Your package is now due on {st['date']}.",
                    f"Delivery is set for {st['date']}.",
                    f"Expect it on {st['date']}.",
                ],
            ),
            answer_keys=[st["date"]],
            analysis="for the current delivery date",
            reasoning=f"The latest delivery date given is {st['date']}; it replaces any earlier date.",
            derived_yes_no=False,
        )

    def ask_order_and_address(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "For my records, what's the order number and where is it shipping?",
                    "Can you confirm both the order number and the address?",
                ],
            ),
            answer=f"Order {order} is shipping to {address}.",
            answer_keys=[order, address],
            analysis="for the order number and the shipping address",
            reasoning=f"The order number is {order} and the address on file is {address}.",
            derived_yes_no=False,
        )

    def ask_price_b(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"How much did I pay for the {item_b}?",
                    f"What did the {item_b} cost me?",
                    f"Remind me what the {item_b} was?",
                    f"I want to give the {item_b} to {_pick(rng, RECIPIENTS)}. What did I pay for it?",
                ],
            ),
            answer=_pick(rng, [f"The {item_b} was ${price_b}.", f"You paid ${price_b} for the {item_b}."]),
            answer_keys=[f"${price_b}"],
            analysis=f"for the price of the {item_b}",
            reasoning=f"The user said the {item_b} was ${price_b}.",
            derived_yes_no=False,
        )

    queries = [
        QuerySpec(
            "single",
            ["order"],
            "your order number",
            ask_order,
            about_order,
        ),
        QuerySpec(
            "single",
            ["address"],
            "the delivery address",
            ask_address,
            [
                (
                    "I moved house recently, so I worry about deliveries.",
                    "Moving is a lot; let's make sure the package finds you.",
                )
            ],
        ),
        QuerySpec(
            "update",
            ["delivery"],
            "the delivery date",
            ask_delivery,
            [
                ("I really need the delivery before my trip.", "I hope the delivery arrives in time for it."),
                ("The tracking page hasn't changed in days.", "Tracking pages are sometimes slow to update."),
            ],
        ),
        QuerySpec(
            "pair",
            ["window", "price_a"],
            f"returning the {item_a} for a refund",
            can_return,
            [(f"Honestly, the {item_a} isn't what I expected.", f"I'm sorry the {item_a} disappointed you.")],
        ),
        QuerySpec(
            "pair",
            ["order", "address"],
            "your order number and shipping address",
            ask_order_and_address,
            about_order,
        ),
        QuerySpec(
            "single",
            ["price_b"],
            f"what you paid for the {item_b}",
            ask_price_b,
            [(f"I'm thinking of giving the {item_b} as a present.", f"A {item_b} makes a thoughtful gift.")],
        ),
    ]
    services = [
        ("Do you offer gift wrapping?", "Yes, gift wrapping is available at checkout."),
        ("Do you ship internationally?", "Yes, we ship to most countries."),
        ("Can I pay with PayPal?", "Yes, we accept PayPal and all major cards."),
        ("Do you have a loyalty program?", "Yes, you earn points on every purchase."),
        ("Do you price match?", "Yes, we match the price of most major stores."),
        ("Can I pick up in a store?", "Yes, most orders can be collected in store."),
    ]

    def quantity_total(r):
        item, n, price = _pick(r, ITEMS), r.randrange(2, 7), r.randrange(12, 150)
        total = n * price
        return _self_contained(
            f"what {n} of an item at ${price} each cost",
            f"{n} x ${price} = ${total}.",
            _pick(
                r,
                [
                    f"If I order {n} of the {item} at ${price} each, what's the total?",
                    f"What would {n} units of the {item} cost at ${price} apiece?",
                    f"I'm buying the {item} for my team: {n} of them at ${price} each. How much is that?",
                ],
            ),
            _pick(r, [f"{n} at ${price} each come to ${total}.", f"That would be ${total} in total."]),
            [f"${total}"],
        )

    def sale_price(r):
        item, pct, price = _pick(r, ITEMS), _pick(r, [10, 20, 25, 30, 40, 50]), r.randrange(20, 400, 20)
        paid = price * (100 - pct) // 100
        return _self_contained(
            f"what a ${price} item costs at {pct}% off",
            f"{pct}% off ${price} takes ${price - paid} off, leaving ${paid}.",
            _pick(
                r,
                [
                    f"The {item} is ${price} and your sale takes {pct}% off. What would I pay?",
                    f"If the ${price} {item} is {pct}% off, what's the sale price?",
                    f"With {pct}% off, how much is a {item} that normally costs ${price}?",
                ],
            ),
            _pick(r, [f"You would pay ${paid}.", f"At {pct}% off, the ${price} {item} comes to ${paid}."]),
            [f"${paid}"],
        )

    def credit_left(r):
        item, credit = _pick(r, ITEMS), _pick(r, [50, 75, 100, 150, 200, 250, 300, 500])
        price = r.randrange(15, credit - 4)
        left = credit - price
        return _self_contained(
            f"how much of ${credit} in store credit is left after a ${price} purchase",
            f"${credit} - ${price} = ${left}.",
            _pick(
                r,
                [
                    f"I have ${credit} in store credit. If I buy a {item} for ${price}, how much is left?",
                    f"After a ${price} {item}, what would remain of my ${credit} store credit?",
                ],
            ),
            _pick(r, [f"${left} of credit would be left.", f"You would have ${left} left in credit."]),
            [f"${left}"],
        )

    def split_order(r):
        people, share = r.randrange(2, 7), r.randrange(9, 120)
        total = people * share
        return _self_contained(
            f"each person's share of a ${total} order split {people} ways",
            f"${total} / {people} = ${share}.",
            _pick(
                r,
                [
                    f"{people} of us are splitting a ${total} order evenly. What does each person pay?",
                    f"If a ${total} order is shared equally by {people} friends, what is each share?",
                    f"We are {people} people sharing the cost of a ${total} {_pick(r, ITEMS)}. What's each "
                    "share?",
                ],
            ),
            _pick(r, [f"Each person pays ${share}.", f"Split {people} ways, that's ${share} each."]),
            [f"${share}"],
        )

    self_contained = [
        SelfContained(
            "the total for several units of an item",
            quantity_total,
            [("I might need a few more of these for the office.", "Bulk orders are no problem for us.")],
        ),
        SelfContained(
            "what an item costs in our sale",
            sale_price,
            [("I heard there's a sale on at the moment.", "There are some good deals on right now.")],
        ),
        SelfContained(
            "how much store credit is left after a purchase",
            credit_left,
            [("I still have some store credit from a return.", "Store credit never expires with us.")],
        ),
        SelfContained(
            "splitting the cost of an order evenly",
            split_order,
            [("My flatmates and I often order things together.", "Group orders can save on shipping.")],
        ),
    ]
    protected = [order, f"${price_a}", f"${price_b}", address, s["date"], new_date]
    return "shop", s, facts, updates, queries, self_contained, services, protected
