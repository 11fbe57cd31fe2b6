package nodepool

import "github.com/vmarena/vmarena/backing"

// A Client lends its granules to other processes attached to its owner and borrows
// theirs (Lend, Borrow): kv's Prefix.Lend and Cache.BorrowPrefix reach them through
// backing.Lender, with no import of this package.
var _ backing.Lender[*Reservation] = (*Client)(nil)
