"""The spa domain of the synthetic corpus (the paper's Fig. 1 kind of dialogue): a membership tier
and its discount rule, services and their prices, therapists and the branches they work at,
appointment times.

draw_domain(rng, pair) returns what generate_dialogue (srt/data/synthetic.py) lays out: the
comment above srt/data/synthetic_common.Round says what each part is.
"""

from __future__ import annotations

from srt.data.synthetic_common import (
    QueryRound,
    QuerySpec,
    Round,
    SelfContained,
    _clock,
    _distinct,
    _other_time,
    _pick,
    _self_contained,
)

NAMES = [
    "Lena",
    "Marco",
    "Priya",
    "Jonas",
    "Aiko",
    "Sofia",
    "Tomas",
    "Nadia",
    "Ravi",
    "Elena",
    "Omar",
    "Greta",
    "Mateo",
    "Ingrid",
    "Kofi",
    "Yara",
    "Dmitri",
    "Leila",
    "Hugo",
    "Amara",
    "Farah",
    "Bruno",
    "Keiko",
    "Anders",
    "Zainab",
    "Luca",
    "Mira",
    "Tariq",
    "Celine",
    "Viktor",
    "Noor",
    "Emil",
]
BRANCHES = [
    "Uptown",
    "Downtown",
    "Riverside",
    "Lakeside",
    "Midtown",
    "Harbor",
    "Westgate",
    "Hillcrest",
    "Northgate",
    "Bayview",
]
TIERS = ["Apex", "Gold", "Silver", "Platinum", "Emerald", "Summit", "Azure", "Onyx"]
SERVICES = [
    "Chakra Balancing",
    "Deep Tissue Massage",
    "Hot Stone Therapy",
    "Aromatherapy Facial",
    "Reflexology Session",
    "Hydra Glow Facial",
    "Bamboo Massage",
    "Salt Scrub Ritual",
    "Lymphatic Drainage",
    "Thai Massage",
    "Seaweed Wrap",
    "Cupping Therapy",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SPA_SLOTS = range(9 * 60, 18 * 60, 15)  # appointment start times, minutes after midnight
WHEN = [  # when a user might come back: context in a query that changes nothing in its answer
    "next week",
    "next month",
    "for my birthday",
    "before my holiday",
    "with my partner",
    "after work one day",
    "on a weekend",
    "in the spring",
    "for my anniversary",
    "with my mother",
    "before a wedding",
    "after my exams",
]


def draw_domain(rng, pair):
    used = set()
    tier, other_tier = rng.sample(TIERS, 2)
    pct, other_pct = rng.sample([10, 15, 20, 25, 30], 2)
    threshold, other_threshold = rng.sample([100, 120, 150, 200], 2)
    used |= {threshold, other_threshold}
    service_a, service_b = rng.sample(SERVICES, 2)
    # the discount query is a fair coin (opposite in the twin); the price lands on the side of the
    # threshold it says
    applies = pair.coin()
    price_a = _distinct(
        rng,
        lambda r: (
            r.randrange(threshold + 5, threshold + 120, 5)
            if applies
            else r.randrange(max(40, threshold - 90), threshold, 5)
        ),
        used,
    )
    price_b = _distinct(rng, lambda r: r.randrange(40, 320, 5), used)
    therapist, therapist_b = rng.sample(NAMES, 2)
    branch = _pick(rng, BRANCHES)
    slot = _pick(rng, SPA_SLOTS)
    s = {"day": _pick(rng, DAYS), "time": _clock(slot)}
    new_day, new_time = (
        _pick(rng, [d for d in DAYS if d != s["day"]]),
        _other_time(rng, SPA_SLOTS, slot),
    )
    rules = [
        f"{tier} Tier gives {pct}% off any service over ${threshold}",
        f"{other_tier} Tier gives {other_pct}% off services over ${other_threshold}",
    ]
    rng.shuffle(rules)
    facts = [
        Round(
            _pick(
                rng,
                [
                    f"I need to check my membership status. I'm under {tier} Tier.",
                    f"Hi, I'm {'an' if tier[0] in 'AEIOU' else 'a'} {tier} Tier member and want to "
                    "book something.",
                    f"Hello! My membership level is {tier} Tier.",
                    f"Just so you know, I hold a {tier} Tier membership.",
                ],
            ),
            _pick(
                rng,
                [
                    "Welcome back. I can confirm your membership.",
                    "Thanks, your membership is confirmed.",
                    "Great, I have found your member profile.",
                    "Lovely, your membership shows as active.",
                ],
            ),
            {"tier": "Q"},
        ),
        Round(
            _pick(
                rng,
                [
                    "How do the member discounts work?",
                    "What do the different tiers get?",
                    "Do members get any discount on treatments?",
                    "Can you explain the tier discounts?",
                ],
            ),
            _pick(
                rng,
                [
                    f"{rules[0]}, and {rules[1]}.",
                    f"Two tiers have discounts: {rules[0]}; {rules[1]}.",
                    f"It depends on the tier. {rules[0]}. {rules[1]}.",
                ],
            ),
            {"rule": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"How much is the {service_a}?",
                    f"What does the {service_a} cost?",
                    f"Could you tell me the price of the {service_a}?",
                ],
            ),
            _pick(
                rng,
                [
                    f"The {service_a} is ${price_a}.",
                    f"The {service_a} costs ${price_a}.",
                    f"Our {service_a} is priced at ${price_a}.",
                ],
            ),
            {"price_a": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"And the {service_b}?",
                    f"What about the {service_b}, how much is that?",
                    f"Is the {service_b} more expensive?",
                ],
            ),
            _pick(
                rng,
                [
                    f"The {service_b} is ${price_b}.",
                    f"The {service_b} costs ${price_b}.",
                    f"We charge ${price_b} for the {service_b}.",
                ],
            ),
            {"price_b": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"Who performs the {service_a}?",
                    f"Which therapist does the {service_a}?",
                    f"Is there a specialist for the {service_a}?",
                ],
            ),
            _pick(
                rng,
                [
                    f"Our senior therapist, {therapist}, is the specialist for the {service_a}.",
                    f"{therapist} performs the {service_a}; they designed that treatment.",
                    f"That would be {therapist}, our {service_a} specialist.",
                ],
            ),
            {"therapist": "A"},
        ),
        Round(
            _pick(rng, [f"Who does the {service_b}?", f"Is the {service_b} done by someone else?"]),
            _pick(
                rng, [f"{therapist_b} handles the {service_b}.", f"The {service_b} is done by {therapist_b}."]
            ),
            {"therapist_b": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    "Where would my treatment take place?",
                    "Which of your locations would I go to?",
                    "Where is the treatment done?",
                ],
            ),
            _pick(
                rng,
                [
                    f"{therapist} only works at our {branch} branch, so it would be there.",
                    f"{therapist} is based at the {branch} branch.",
                    f"You'd see {therapist} at our {branch} location.",
                ],
            ),
            {"branch": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"Can I book the {service_a} this week?",
                    "Could you put me down for an appointment?",
                    f"I'd like to schedule the {service_a}, please.",
                ],
            ),
            _pick(
                rng,
                [
                    f"Done, you're booked for {s['day']} at {s['time']}.",
                    f"Your appointment is set for {s['day']} at {s['time']}.",
                ],
            ),
            {"appointment": "A"},
        ),
    ]
    updates = {
        "appointment": Round(
            _pick(
                rng,
                [
                    "Actually, something came up. Could we move my appointment?",
                    "Can I switch my appointment to another slot?",
                    "I need to reschedule, sorry.",
                ],
            ),
            _pick(
                rng,
                [
                    f"No problem, your appointment is now {new_day} at {new_time}.",
                    f"I've moved you to {new_day} at {new_time}.",
                ],
            ),
            {"appointment": "A"},
            apply=lambda st: st.update(day=new_day, time=new_time),
            kind="update",
        )
    }

    def discount(st):
        verdict = (
            f"Yes. The {service_a} is ${price_a}, which is over ${threshold}, so your {pct}% "
            f"{tier} Tier discount applies."
            if applies
            else f"No. The {service_a} is ${price_a}, which is not over ${threshold}, so your "
            f"{pct}% {tier} Tier discount does not apply."
        )
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"For that {service_a} booking, will my discount apply?",
                    f"Great. So will my member discount work on the {service_a}?",
                    f"Do I get my tier discount on the {service_a}?",
                    f"Would my membership knock anything off the {service_a}?",
                ],
            ),
            answer=verdict,
            answer_keys=["yes" if applies else "no", f"${price_a}"],
            analysis=f"whether their membership discount applies to the {service_a}",
            reasoning=f"The user is {tier} Tier; that tier gives {pct}% off services over ${threshold}. "
            f"The {service_a} costs ${price_a}, which is {'over' if applies else 'not over'} ${threshold}, "
            f"so the discount {'applies' if applies else 'does not apply'}.",
            derived_yes_no=True,
        )

    def cheaper(st):
        name, price = (service_a, price_a) if price_a < price_b else (service_b, price_b)
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"Which is cheaper, the {service_a} or the {service_b}?",
                    f"Between the {service_a} and the {service_b}, which costs less?",
                    f"Is the {service_a} or the {service_b} the less expensive one?",
                ],
            ),
            answer=_pick(rng, [f"The {name} is cheaper, at ${price}.", f"The {name}: it's ${price}."]),
            answer_keys=[f"${price}"],
            analysis="which of the two services costs less",
            reasoning=f"The {service_a} costs ${price_a} and the {service_b} costs ${price_b}, so "
            f"the {name} is cheaper.",
            derived_yes_no=False,
        )

    about_a = [
        (
            f"My sister tried the {service_a} last month and loved it.",
            f"The {service_a} is one of our favourites.",
        ),
        (
            f"I've been curious about the {service_a} for a while.",
            f"Many guests come back for the {service_a}.",
        ),
        (f"Is the {service_a} relaxing?", f"Most guests find the {service_a} very relaxing."),
    ]

    def ask_price_a(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"Remind me, how much was the {service_a}?",
                    f"What was the price of the {service_a} again?",
                    f"Sorry, what did you say the {service_a} costs?",
                    f"How much did you say the {service_a} was?",
                    f"I'd like the {service_a} {_pick(rng, WHEN)}. What does it cost?",
                    f"If I book the {service_a} {_pick(rng, WHEN)}, what will I pay?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"The {service_a} is ${price_a}.",
                    f"The {service_a} costs ${price_a}.",
                    f"It's ${price_a} for the {service_a}.",
                ],
            ),
            answer_keys=[f"${price_a}"],
            analysis=f"for the price of the {service_a}",
            reasoning=f"The price was stated earlier: the {service_a} is ${price_a}.",
            derived_yes_no=False,
        )

    def ask_therapist_and_branch(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"So who would do my {service_a}, and where?",
                    f"Who am I seeing for the {service_a}, and at which branch?",
                    f"Which therapist does my {service_a}, and at which location?",
                    f"Remind me who does the {service_a} and where I should go?",
                    f"If I book the {service_a} {_pick(rng, WHEN)}, who do I see and where?",
                    f"I'll come in for the {service_a} {_pick(rng, WHEN)}. Who does it, and at which branch?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"{therapist} performs it, at the {branch} branch.",
                    f"You'd see {therapist} at our {branch} branch.",
                    f"{therapist} does the {service_a}, at the {branch} location.",
                ],
            ),
            answer_keys=[therapist, branch],
            analysis=f"who performs the {service_a} and at which branch",
            reasoning=f"{therapist} is the {service_a} specialist and works at the {branch} branch.",
            derived_yes_no=False,
        )

    def ask_appointment(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "What time is my appointment again?",
                    "When am I booked in?",
                    "Can you confirm my appointment time?",
                    "When is my appointment now?",
                    "What day and time am I booked for?",
                    "So when should I come in for my appointment?",
                    "Which day was my appointment, and at what time?",
                    "I need to put my appointment in my calendar. When is it?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"Your appointment is on {st['day']} at {st['time']}.",
                    f"You're booked for {st['day']} at {st['time']}.",
                    f"You're seeing us on {st['day']} at {st['time']}.",
                    f"It's {st['day']} at {st['time']}.",
                    f"We have you down for {st['day']} at {st['time']}.",
                ],
            ),
            answer_keys=[st["day"], st["time"]],
            analysis="for the current appointment time",
            reasoning=f"The most recent booking says {st['day']} at {st['time']}; a later change "
            "overrides an earlier one.",
            derived_yes_no=False,
        )

    def ask_therapist_b(st):
        when = _pick(rng, WHEN)
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"Who was it that does the {service_b}?",
                    f"Remind me who performs the {service_b}?",
                    f"Which therapist did you say does the {service_b}?",
                    f"Who would I see for the {service_b}?",
                    f"If I come back {when} for the {service_b}, who would do it?",
                    f"I might book the {service_b} {when}. Who performs it?",
                    f"I'd like the {service_b} {when}. Who would I be seeing?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"{therapist_b} does the {service_b}.",
                    f"The {service_b} is done by {therapist_b}.",
                    f"That's {therapist_b}, who does the {service_b}.",
                ],
            ),
            answer_keys=[therapist_b],
            analysis=f"who performs the {service_b}",
            reasoning=f"Earlier I said the {service_b} is done by {therapist_b}.",
            derived_yes_no=False,
        )

    queries = [
        QuerySpec(
            "single",
            ["price_a"],
            f"the price of the {service_a}",
            ask_price_a,
            about_a,
        ),
        QuerySpec(
            "pair",
            ["therapist", "branch"],
            f"who does the {service_a} and where",
            ask_therapist_and_branch,
            about_a,
        ),
        QuerySpec(
            "triple",
            ["tier", "rule", "price_a"],
            f"your member discount on the {service_a}",
            discount,
            [
                ("I love getting a good deal on treatments.", "Our members do save quite a bit over a year."),
                (
                    f"I'm trying to keep the {service_a} within my budget.",
                    "That makes sense; treatments add up.",
                ),
            ],
        ),
        QuerySpec(
            "update",
            ["appointment"],
            "your appointment time",
            ask_appointment,
            [
                ("I keep forgetting my appointments lately.", "A reminder on your phone can help with that."),
                (
                    "My calendar is a mess this week.",
                    "Busy weeks happen; we can help keep track of your booking.",
                ),
            ],
        ),
        QuerySpec(
            "pair",
            ["price_a", "price_b"],
            f"the prices of the {service_a} and the {service_b}",
            cheaper,
            [
                (
                    f"I can't decide between the {service_a} and the {service_b}.",
                    "Both are popular choices with our guests.",
                )
            ],
        ),
        QuerySpec(
            "single",
            ["therapist_b"],
            f"who does the {service_b}",
            ask_therapist_b,
            [(f"A friend recommended the {service_b} to me.", f"The {service_b} has lovely reviews.")],
        ),
    ]
    services = [
        ("Do you sell gift cards?", "Yes, gift cards are available at the front desk in any amount."),
        ("What are your opening hours?", "We are open from early morning until late every day."),
        ("Is there parking nearby?", "Yes, every branch has free parking for guests."),
        ("Do I need to bring anything to a session?", "No, we provide robes, towels and slippers."),
        ("Can I bring a friend along?", "Yes, we have couple rooms if you book them ahead."),
        ("Do you sell the oils you use?", "Yes, our oils are on sale at the reception desk."),
    ]

    def sessions_total(r):
        service, n, price = _pick(r, SERVICES), r.randrange(2, 7), r.randrange(40, 200, 5)
        total = n * price
        return _self_contained(
            f"what {n} sessions at ${price} each cost in all",
            f"{n} sessions at ${price} each: {n} x ${price} = ${total}.",
            _pick(
                r,
                [
                    f"If I book {n} {service} sessions at ${price} each, what do I pay in all?",
                    f"What would {n} sessions of the {service} come to at ${price} a session?",
                    f"Say I buy a pack of {n} {service} sessions at ${price} each. What's the total?",
                ],
            ),
            _pick(
                r,
                [
                    f"{n} sessions at ${price} each come to ${total} in all.",
                    f"That would be ${total}: {n} sessions at ${price} each.",
                ],
            ),
            [f"${total}"],
        )

    def tip(r):
        service, pct = _pick(r, SERVICES), _pick(r, [10, 15, 20, 25])
        price = r.randrange(40, 300, 10 if pct in (10, 20) else 20)
        amount = price * pct // 100
        return _self_contained(
            f"how much a {pct}% tip on ${price} is",
            f"{pct}% of ${price} is ${amount}.",
            _pick(
                r,
                [
                    f"I'd like to leave a {pct}% tip on my ${price} {service}. How much is that?",
                    f"What's a {pct}% tip on a ${price} {service}?",
                    f"How much should I add for a {pct}% tip on the ${price} {service}?",
                ],
            ),
            _pick(
                r,
                [
                    f"A {pct}% tip on ${price} is ${amount}.",
                    f"That's ${amount}, which is {pct}% of ${price}.",
                ],
            ),
            [f"${amount}"],
        )

    def gift_card_left(r):
        service, card = _pick(r, SERVICES), _pick(r, [50, 75, 100, 120, 150, 200, 250, 300])
        price = r.randrange(25, card, 5)
        left = card - price
        return _self_contained(
            f"what is left on a ${card} gift card after a ${price} treatment",
            f"${card} - ${price} = ${left}.",
            _pick(
                r,
                [
                    f"I have a ${card} gift card. If I use it for the {service} at ${price}, what's left "
                    "on it?",
                    f"How much would remain on my ${card} gift card after a ${price} {service}?",
                ],
            ),
            _pick(
                r,
                [
                    f"${left} would be left on the card.",
                    f"After the ${price} {service}, ${left} remains on your ${card} card.",
                ],
            ),
            [f"${left}"],
        )

    def finish_time(r):
        service, minutes, start = _pick(r, SERVICES), _pick(r, [30, 45, 60, 75, 90, 120]), _pick(r, SPA_SLOTS)
        begin, end = _clock(start), _clock(start + minutes)
        return _self_contained(
            f"when a {minutes}-minute treatment that starts at {begin} finishes",
            f"{begin} plus {minutes} minutes is {end}.",
            _pick(
                r,
                [
                    f"If my {minutes}-minute {service} starts at {begin}, when will it finish?",
                    f"I'm booked for a {minutes}-minute {service} at {begin}. What time will I be done?",
                ],
            ),
            _pick(
                r, [f"It would finish at {end}.", f"A {minutes}-minute session from {begin} ends at {end}."]
            ),
            [end],
        )

    self_contained = [
        SelfContained(
            "the total for several sessions of a treatment",
            sessions_total,
            [
                ("I'm thinking about booking several sessions this season.", "A course works really well."),
                ("I want to treat myself to a few sessions this year.", "You deserve a bit of pampering."),
            ],
        ),
        SelfContained(
            "how much to tip on a treatment",
            tip,
            [("I never know how much to tip for a treatment.", "Lots of guests wonder about that.")],
        ),
        SelfContained(
            "what is left on a gift card after a treatment",
            gift_card_left,
            [("Someone gave me a spa gift card for my birthday.", "What a lovely present.")],
        ),
        SelfContained(
            "what time a treatment finishes",
            finish_time,
            [("I need to know when my treatment will be done.", "We'll make sure you're not late.")],
        ),
    ]
    protected = [f"${p}" for p in (price_a, price_b)] + [
        therapist,
        therapist_b,
        branch,
        s["day"],
        s["time"],
        new_day,
        new_time,
    ]
    return "spa", s, facts, updates, queries, self_contained, services, protected
